"""KDA forward kernels: the chunked prefill path and the token-recurrent decode/verify path."""
from .chunk import chunk_kda_fwd
from .recurrent import recurrent_kda

__all__ = ["chunk_kda_fwd", "recurrent_kda"]
