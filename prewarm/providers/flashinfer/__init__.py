"""FlashInfer: the modules it JIT-builds at first use (``jit``: its AOT dir, built by its own code), reached through
a server's calls (sglang's sampling)."""
from __future__ import annotations

from ..contract import Integration


class FlashInfer(Integration):
    name = "flashinfer"
    jit_library = "prewarm.providers.flashinfer.jit:FlashInferJit"
