"""fla-core (flash-linear-attention): its KDA kernels as a server calls them through fla's public API (``kda``)."""
from __future__ import annotations

from ..contract import Integration


class Fla(Integration):
    name = "fla"
    kernel_providers = {"*": "prewarm.providers.fla.kda"}
