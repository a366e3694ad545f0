"""KDA forward kernels: the chunked prefill path and the token-recurrent decode/verify path.

Importing the package registers every KDA kernel with ``prewarm_kernels.backend`` (the two entry points import all
kernel modules, and each registers itself)."""
from .chunk import chunk_kda_fwd
from .recurrent import recurrent_kda

__all__ = ["chunk_kda_fwd", "recurrent_kda"]
