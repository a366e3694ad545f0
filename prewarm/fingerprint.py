"""The environment fingerprint: every factor that can make a cached binary a miss or, worse, silently wrong.

Triton's own key covers its version and sources, the Python ABI (through libtriton), the backend target, ptxas
(CUDA) and a fixed list of env vars. It does NOT cover, among others, the Ascend CANN / bishengir-compile
version, several Ascend codegen env vars, or torch. A bundle carries the fingerprint it was built under; install
and verify compare it with the node's and refuse where a factor that changes code or keys differs.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass

from . import tritoncompat

UNKNOWN = "unknown"

# Factors whose difference means the cache would miss (a compile on the node) or hold wrong code: refuse.
# Every other factor is informational: shown, never refused on.
BLOCKING_PREFIXES = ("triton.", "python.", "target.", "cuda.ptxas", "env.", "ascend.")

WHY = {
    "triton.distribution": "a different Triton build produces different keys and code",
    "triton.version": "Triton's version is the first part of every cache key",
    "triton.key": "Triton's compiler/language sources or libtriton differ: every key differs",
    "python.abi": "libtriton differs per Python minor version, so every key differs",
    "target.backend": "kernels compiled for another backend cannot run here",
    "target.arch": "kernels compiled for another architecture are a miss (or cannot load)",
    "cuda.ptxas": "ptxas --version is part of Triton's CUDA backend hash",
    "torch.version": "not part of Triton's key; shown for the record",
}


@dataclass(frozen=True)
class Mismatch:
    factor: str
    built: str
    node: str
    blocking: bool
    why: str

    def __str__(self) -> str:
        return f"{self.factor}: bundle has {self.built!r}, this node has {self.node!r} ({self.why})"


def is_blocking(factor: str) -> bool:
    return factor.startswith(BLOCKING_PREFIXES)


def _ptxas_version() -> str:
    try:
        from triton import knobs

        path = knobs.nvidia.ptxas.path
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        return text.strip().splitlines()[-1] if text.strip() else UNKNOWN
    except Exception:
        return UNKNOWN


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except Exception:
        return UNKNOWN


def current(backend: str | None = None, arch: str | None = None) -> dict[str, str]:
    """This environment's factors. ``backend``/``arch`` are the build target (from a manifest), else detected."""
    dist, version = tritoncompat.triton_distribution()
    factors = {
        "triton.distribution": dist,
        "triton.version": version,
        "triton.key": tritoncompat.triton_key(),
        "python.abi": f"{sys.implementation.cache_tag}-{platform.machine()}",
        "torch.version": _torch_version(),
    }
    backend = backend or detect_backend()
    factors["target.backend"] = backend
    factors["target.arch"] = arch or detect_arch(backend)
    if backend == "cuda":
        factors["cuda.ptxas"] = _ptxas_version()
    for name, value in sorted(tritoncompat.cache_invalidating_env_vars().items()):
        factors[f"env.{name}"] = str(value)
    return factors


def detect_backend() -> str:
    """The backend this node runs: npu where torch_npu sees a device, cuda where the triton dist is upstream."""
    dist, _ = tritoncompat.triton_distribution()
    return "npu" if dist == "triton-ascend" else "cuda"


def detect_arch(backend: str) -> str:
    """The node's architecture, or UNKNOWN where no device is visible (a build box, a CI machine)."""
    if backend == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                return f"sm_{major}{minor}"
        except Exception:
            pass
    return os.environ.get("TRITON_ASCEND_ARCH", UNKNOWN) if backend == "npu" else UNKNOWN


def compare(built: dict[str, str], node: dict[str, str]) -> list[Mismatch]:
    """Each factor that differs. A factor UNKNOWN on either side is not a mismatch (it could not be checked)."""
    out = []
    for factor in sorted(set(built) | set(node)):
        b, n = built.get(factor, "unset" if factor.startswith("env.") else UNKNOWN), node.get(
            factor, "unset" if factor.startswith("env.") else UNKNOWN
        )
        if b == n or UNKNOWN in (b, n):
            continue
        why = WHY.get(factor) or (
            "a codegen env var: Triton folds it into its key" if factor.startswith("env.") else "differs"
        )
        out.append(Mismatch(factor, b, n, is_blocking(factor), why))
    return out
