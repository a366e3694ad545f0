"""Build targets: where and how a planned request becomes a cache entry (like Triton's runtime/cache.py managers).

A :class:`Target` is activated once per process (the build's parent and each worker). After that the real JIT
path (``warmup`` / ``preload``) compiles for it. Concrete targets:

- :class:`CudaOfflineTarget`: no GPU. Installs a target-only driver, so Triton compiles for ``sm_XX`` without
  libcuda, and builds each kernel's launcher (the per-signature C ``.so`` Triton builds at first launch) and
  ``cuda_utils.so`` with the host C compiler. Autotune results cannot be made here (nothing to benchmark on).
- :class:`CudaDeviceTarget`: a real GPU. Compiles the same way, then runs each provider's ``run(spec, device)``
  once so autotune results and launchers land in the cache dir too.
- ``NpuTarget`` (Ascend, compile-only launches): added by the Ascend engineer; it registers itself with
  :func:`register` under ``("npu", "device")`` (and whatever other modes it supports).

Workers are spawned processes: a target must be picklable (plain dataclass fields only).
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import BuildError, EnvironmentProblem, ManifestError

MODES = ("offline", "device", "auto")


@dataclass
class Target(ABC):
    """One build target: a backend + arch, and how to compile for it in this process."""

    backend: str
    arch: str
    device_profile: str | None = None  # a prewarm.devices profile name: device queries answer as that device
    mode: ClassVar[str] = ""

    @abstractmethod
    def activate(self) -> None:
        """Make Triton in this process compile for this target (install a driver, set env). Idempotent."""

    def compile(self, fn: Any, specialization_data: str) -> Any:
        """Compile one request through the real JIT path. ``fn`` is the JITFunction the data was recorded on."""
        from . import tritoncompat

        return tritoncompat.preload(fn, specialization_data)

    def after_build(self, providers: list[Any], spec: dict, cache_dir: str) -> list[str]:
        """Run once in the parent after every request compiled (device mode: autotune, launchers).

        Returns notes for the build report. The default (no device) does nothing.
        """
        return []

    def notes(self) -> list[str]:
        """Caveats a person must know about caches built by this target (shown by plan and build)."""
        return []

    def describe(self) -> str:
        return f"{self.backend} {self.arch} ({self.mode})"


def parse_cuda_arch(arch: str) -> int:
    """"sm_90" / "sm90" / "90" -> 90."""
    text = arch.lower().removeprefix("sm_").removeprefix("sm")
    if not text.isdigit():
        raise ManifestError(f"target.arch: {arch!r} is not a CUDA arch; expected e.g. 'sm_90'")
    return int(text)


class OfflineDriver:
    """The smallest driver Triton's JIT needs to compile (no launch): a target, device 0, stream 0."""

    def __init__(self, backend: str, arch: int | str, warp_size: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(backend, arch, warp_size)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


@dataclass
class CudaOfflineTarget(Target):
    """CUDA without a GPU: the real compiler pipeline down to cubin, through a target-only driver."""

    mode: ClassVar[str] = "offline"

    def activate(self) -> None:
        from triton.runtime.driver import driver

        wanted = OfflineDriver("cuda", parse_cuda_arch(self.arch), 32)
        current = driver._active  # .active would create the CUDA driver
        if not (isinstance(current, OfflineDriver) and current.target == wanted.target):
            driver.set_active(wanted)
        if self.device_profile:
            from . import devices

            devices.activate(devices.lookup(self.device_profile, "target"))

    def compile(self, fn: Any, specialization_data: str) -> Any:
        """Compile, then build the kernel's launcher into the cache too (the node then runs no C compiler)."""
        from . import tritoncompat

        kernel = super().compile(fn, specialization_data)
        try:
            tritoncompat.cuda_launcher(kernel, build=True)
        except Exception:  # no C compiler here: after_build says so; the node builds the launcher itself
            pass
        return kernel

    def after_build(self, providers: list[Any], spec: dict, cache_dir: str) -> list[str]:
        from . import tritoncompat

        try:
            with tritoncompat.cache_scope(cache_dir):
                tritoncompat.cuda_utils(build=True)
        except Exception as e:
            return [f"launchers and cuda_utils.so were not built ({type(e).__name__}: {e}); the node builds them "
                    f"at first launch, which needs a C compiler there"]
        return []

    def notes(self) -> list[str]:
        return [
            "offline CUDA build: kernels, their launchers and cuda_utils.so are in the cache, but no autotune "
            "results: autotuned kernels benchmark once per process on the node unless a device build ran"
        ]


@dataclass
class CudaDeviceTarget(Target):
    """CUDA on a real GPU: compile, then run each provider's serving mix once (autotune + launchers on disk)."""

    mode: ClassVar[str] = "device"
    device: str = "cuda:0"

    def activate(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise EnvironmentProblem(
                "cuda device mode: no CUDA device visible (torch.cuda.is_available() is False); "
                "use --mode offline to compile without a GPU"
            )
        major, minor = torch.cuda.get_device_capability()
        if major * 10 + minor != parse_cuda_arch(self.arch):
            raise EnvironmentProblem(
                f"cuda device mode: the manifest targets {self.arch} but this GPU is sm_{major}{minor}"
            )

    def after_build(self, providers: list[Any], spec: dict, cache_dir: str) -> list[str]:
        """Run each provider's serving mix once in a fresh process with autotune caching on: the Autotuner
        reads TRITON_CACHE_AUTOTUNING when the kernel module is imported, so it cannot be switched on here."""
        import json
        import subprocess
        import sys

        env = {**os.environ, "TRITON_CACHE_DIR": cache_dir, "TRITON_CACHE_AUTOTUNING": "1"}
        notes = []
        for provider in providers:
            if not callable(getattr(provider, "run", None)):
                continue
            code = f"import importlib,json; importlib.import_module({provider.__name__!r}).run(json.loads({json.dumps(json.dumps(spec))}), {self.device!r})"
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            if done.returncode:
                raise BuildError(f"{provider.__name__}.run(spec, {self.device!r}) failed:\n{done.stderr[-4000:]}")
            notes.append(f"ran {provider.__name__}.run once on {self.device}: autotune results and launchers cached")
        notes.append("nodes must run with TRITON_CACHE_AUTOTUNING=1 (or cache_results=True) to read autotune results")
        return notes


_REGISTRY: dict[tuple[str, str], type[Target]] = {
    ("cuda", "offline"): CudaOfflineTarget,
    ("cuda", "device"): CudaDeviceTarget,
}


def register(backend: str, mode: str, cls: type[Target]) -> None:
    """Add a target class (the Ascend engineer's NpuTarget registers ("npu", "device") here)."""
    _REGISTRY[(backend, mode)] = cls


def _auto_mode(backend: str) -> str:
    if backend == "cuda":
        try:
            import torch

            return "device" if torch.cuda.is_available() else "offline"
        except ImportError:
            return "offline"
    modes = sorted(m for b, m in _REGISTRY if b == backend)
    return "device" if "device" in modes else (modes[0] if modes else "device")


def _load_plugins(backend: str) -> None:
    """Import the module that registers a backend's targets (kept out of this file's imports)."""
    if backend == "npu" and not any(b == "npu" for b, _ in _REGISTRY):
        try:
            import importlib

            importlib.import_module("prewarm.npu")
        except ImportError:
            pass


def get_target(backend: str, arch: str, mode: str = "auto", device_profile: str | None = None) -> Target:
    """The target that builds ``backend``/``arch`` in ``mode`` (offline | device | auto); an offline target
    answers device queries as ``device_profile`` (a :mod:`prewarm.devices` name) in every process it activates."""
    if mode not in MODES:
        raise ManifestError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    _load_plugins(backend)
    if mode == "auto":
        mode = _auto_mode(backend)
    cls = _REGISTRY.get((backend, mode))
    if cls is None:
        have = ", ".join(f"{b}/{m}" for b, m in sorted(_REGISTRY))
        raise EnvironmentProblem(f"no build target for backend {backend!r} in mode {mode!r} (available: {have})")
    return cls(backend=backend, arch=arch, device_profile=device_profile)


def activate_profile(backend: str, arch: str, device_profile: str) -> None:
    """Plan processes: device queries answer as ``device_profile`` unless a real device answers them (a device
    build on the node). With no driver chosen yet, the backend's target-only driver is installed first."""
    from . import devices

    current = devices.chosen_driver()
    if isinstance(current, OfflineDriver):
        devices.activate(devices.lookup(device_profile, "target"))
    elif current is None and backend == "cuda" and _auto_mode("cuda") == "offline":
        CudaOfflineTarget(backend, arch, device_profile).activate()
