"""CUDA: the offline (target-only) and device build targets, and the C modules Triton builds at first launch.

- :class:`CudaOfflineTarget`: no GPU. Installs a target-only driver, so Triton compiles for ``sm_XX`` without
  libcuda, and builds each kernel's launcher (the per-signature C ``.so`` Triton builds at first launch) and
  ``cuda_utils.so`` with the host C compiler. Autotune results cannot be measured here (nothing to benchmark on):
  build writes them from an autotune table measured on one device (prewarm.building.autotune).
- :class:`CudaDeviceTarget`: a real GPU. Compiles the same way, then runs each provider's ``run(spec, device)``
  once so autotune results and launchers land in the cache dir too.
- :func:`probe_modules`: are a plan's launchers and ``cuda_utils`` in a cache dir (the driver's own classes asked).
"""
from __future__ import annotations

import contextlib
import functools
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ... import devices
from .. import tritoncompat
from ...errors import BuildError, EnvironmentProblem, ManifestError
from ...planning.plan import resolve
from .target import Target


def parse_cuda_arch(arch: str) -> int:
    """"sm_90" / "sm90" / "90" -> 90."""
    text = arch.lower().removeprefix("sm_").removeprefix("sm")
    if not text.isdigit():
        raise ManifestError(f"target.arch: {arch!r} is not a CUDA arch; expected e.g. 'sm_90'")
    return int(text)


def gpu_present() -> bool:
    """Does torch see a CUDA device here (False without torch)?"""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def activate_offline(arch: str, device_profile: str | None = None) -> None:
    """The one place a CUDA process gets its target-only driver: Triton compiles for ``arch`` without libcuda, and
    device queries answer as ``device_profile`` (a :mod:`prewarm.devices` name). Idempotent."""
    from triton.runtime.driver import driver

    wanted = devices.OfflineDriver("cuda", parse_cuda_arch(arch), 32)
    current = tritoncompat.chosen_driver()
    if not (isinstance(current, devices.OfflineDriver) and current.target == wanted.target):
        driver.set_active(wanted)
    if device_profile:
        devices.activate(devices.lookup(device_profile, "target"))


def activate_for_planning(arch: str, device_profile: str | None) -> None:
    """A process that only plans: device queries answer as ``device_profile`` unless a real GPU answers them;
    with no profile nothing is needed (providers plan on meta tensors)."""
    current = tritoncompat.chosen_driver()
    if device_profile and (isinstance(current, devices.OfflineDriver) or current is None and not gpu_present()):
        activate_offline(arch, device_profile)


@dataclass
class CudaOfflineTarget(Target):
    """CUDA without a GPU: the real compiler pipeline down to cubin, through a target-only driver."""

    mode: ClassVar[str] = "offline"

    def activate(self) -> None:
        activate_offline(self.arch, self.device_profile)

    def compile(self, fn: Any, specialization_data: str) -> Any:
        """Compile, then build the kernel's launcher into the cache too (the node then runs no C compiler)."""
        kernel = super().compile(fn, specialization_data)
        try:
            launcher(kernel, build=True)
        except Exception:  # no C compiler here: after_build says so; the node builds the launcher itself
            pass
        return kernel

    def after_build(self, providers: list[Any], spec: dict, cache_dir: str) -> list[str]:
        try:
            with tritoncompat.cache_scope(cache_dir):
                cuda_utils(build=True)
        except Exception as e:
            return [f"launchers and cuda_utils.so were not built ({type(e).__name__}: {e}); the node builds them "
                    f"at first launch, which needs a C compiler there"]
        return []

    def notes(self) -> list[str]:
        return [
            "offline CUDA build: kernels, their launchers and cuda_utils.so are in the cache, but no autotune "
            "results of its own: they come from the manifest's autotune table ([target] tuned or --tuned, made by "
            "`prewarm tune` on one device); a tuning key it lacks is benchmarked once per process on the node"
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
        start_driver()

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


def start_driver() -> None:
    """Bring Triton's CUDA driver up now, as a server's first launch does, before any probe scope.

    The driver is made at its first use, and making it loads (or builds) ``cuda_utils`` through the cache manager.
    Inside a probe's scope that lookup was stopped as if it were the kernel's: on a fresh GPU node, will-hit named
    the cuda_utils key for a kernel (a false MISS), and libraries that ask the driver at import (sglang's fla copy:
    ``get_current_target()``) caught the failure, fell back to "cpu" and picked other constexpr globals (ieee
    instead of tf32 dots), so verify computed other keys than the server does. Measured on the H200, 2026-12-01.
    Its C modules go to a private dir here, so checking a cache writes nothing into it."""
    import tempfile

    from triton.runtime.driver import driver

    if tritoncompat.chosen_driver() is not None:
        return
    with tempfile.TemporaryDirectory(prefix="prewarm-driver-") as scratch, tritoncompat.cache_scope(scratch):
        driver.active.get_current_target()


TARGETS: dict[str, type[Target]] = {"offline": CudaOfflineTarget, "device": CudaDeviceTarget}


def auto_mode() -> str:
    return "device" if gpu_present() else "offline"


# --- CUDA launchers without a GPU -------------------------------------------------------------------------------
# Triton (3.4+) builds a C launcher per kernel signature, and cuda_utils once, with the host C compiler at first
# launch, keyed by their source and the platform (not by the GPU): built here they are found on the node, which then
# needs no compiler and spends no time in it. Linking needs libcuda.so.1; without the NVIDIA driver an empty stub
# with that soname stands in for the link only (the cu* symbols resolve against the node's libcuda at load time).


@functools.lru_cache()
def _driver_installed() -> bool:
    from triton.backends.nvidia import driver as nv

    nv.libcuda_dirs.cache_clear()
    try:
        nv.libcuda_dirs()  # asserts that libcuda.so.1 is there
        return True
    except Exception:
        return False
    finally:
        nv.libcuda_dirs.cache_clear()


@functools.lru_cache()
def _libcuda_stub(cc: str | None) -> str:
    """A dir (one per process and compiler, removed at exit) holding a stand-in ``libcuda.so.1``: an empty file for a
    lookup (``cc`` None), else the device profile's driver stub (:func:`prewarm.devices.driver_stub`) plus a ``cc``
    wrapper that keeps it linked."""
    import atexit
    import shutil
    import tempfile

    if cc is None:
        stub = tempfile.mkdtemp(prefix="prewarm-libcuda-")
        atexit.register(shutil.rmtree, stub, ignore_errors=True)
        Path(stub, devices.DRIVER_LIBRARY).touch()
        return stub
    stub = devices.driver_stub(cc)
    # where a launcher references no entry point by link, a linker that drops unused libraries (--as-needed,
    # Ubuntu's default) would leave libcuda.so.1 out of the .so's NEEDED list: keep it, as a link against the real
    # driver does
    Path(stub, "cc").write_text(f'#!/bin/sh\nexec "{cc}" -Wl,--no-as-needed "$@"\n')
    os.chmod(os.path.join(stub, "cc"), 0o755)
    return stub


@contextlib.contextmanager
def _libcuda(link: bool):
    """``libcuda.so.1`` as Triton's launcher classes need it: they assert that it exists before anything else, and
    building links against it. Where the driver is not installed a stand-in is used (see ``_libcuda_stub``)."""
    import shutil

    from triton.backends.nvidia import driver as nv

    if _driver_installed():  # look up and link against the real driver
        yield
        return
    cc = None
    if link:
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")  # as Triton's build picks it
        if cc is None:
            raise RuntimeError("no C compiler (gcc, clang or $CC) to build launchers with")
    stub = _libcuda_stub(cc)
    # both read at use, and neither is one of the cache key's env vars
    with tritoncompat.restored_env("TRITON_LIBCUDA_PATH", "CC"):
        os.environ["TRITON_LIBCUDA_PATH"] = stub
        if link:
            os.environ["CC"] = os.path.join(stub, "cc")
        nv.libcuda_dirs.cache_clear()
        nv.library_dirs.cache_clear()
        try:
            yield
        finally:
            nv.libcuda_dirs.cache_clear()
            nv.library_dirs.cache_clear()


class _Unloaded(types.ModuleType):
    """Stands in for a built module that is not loaded (that needs the NVIDIA driver): every attribute is None."""

    def __getattr__(self, name):
        return None


@contextlib.contextmanager
def _build_without_loading():
    """Triton's ``compile_module_from_src`` builds a missing module into the cache, then imports it; here the
    import is skipped, so a module already in the cache is left as is (an import failure would rebuild it)."""
    import triton.runtime.build as tb

    saved = tb._load_module_from_path
    tb._load_module_from_path = lambda name, path: _Unloaded(name)
    try:
        with _libcuda(link=True):
            yield
    finally:
        tb._load_module_from_path = saved


def has_cuda_launchers() -> bool:
    """Does this triton build C launchers per kernel signature (upstream 3.4+ with the NVIDIA backend)?"""
    try:
        from triton.backends.nvidia.driver import CudaLauncher  # noqa: F401
    except ImportError:
        return False
    return True


def launcher(kernel, build: bool) -> None:
    """The launcher ``.so`` of a compiled kernel (``preload``'s result) as the CUDA driver makes it at first launch:
    built into the active cache dir (``build``), or only looked up (the active cache manager sees the lookup)."""
    from triton.backends.nvidia.driver import CudaLauncher

    with _build_without_loading() if build else _libcuda(link=False):
        CudaLauncher(kernel.src, kernel.metadata)


def cuda_utils(build: bool) -> None:
    """``cuda_utils.so``, what the CUDA driver builds when a process first uses it: built or looked up, as above."""
    from triton.backends.nvidia import driver as nv

    saved = getattr(nv, "PyCUtensorMap", None)  # CudaUtils() sets this module global from what it loads
    try:
        with _build_without_loading() if build else _libcuda(link=False):
            nv.CudaUtils.__init__(object.__new__(nv.CudaUtils))  # not the driver's singleton instance
    finally:
        nv.PyCUtensorMap = saved


def probe_modules(compiles: list, results: list, cache_dir: str) -> list:
    """For every planned compile that hits (``results``: prewarm.building.probe's), is its launcher in ``cache_dir``, and is
    cuda_utils? One ``ModuleResult`` per module key; none where this Triton builds no C launchers."""
    from ..probe import ModuleResult, Probe, ProbeCacheManager, ReadOnlyCacheManager

    if not has_cuda_launchers():
        return []
    root = os.path.realpath(cache_dir)
    with tritoncompat.cache_scope(os.path.abspath(cache_dir), ReadOnlyCacheManager):
        kernels = [tritoncompat.load_compiled(resolve(c.kernel), c.specialization)
                   for c, r in zip(compiles, results) if r.hit]  # disk hits: loaded, nothing compiled
    found: dict[str, ModuleResult] = {}

    def lookup(name: str, run) -> None:
        try:
            run()
        except Probe as p:
            m = found.setdefault(p.key, ModuleResult(name, p.key, os.path.isfile(os.path.join(root, p.key,
                                                                                             p.filename)), 0))
            m.kernels += name != "cuda_utils"

    with tritoncompat.cache_scope(os.path.abspath(cache_dir), ProbeCacheManager):
        lookup("cuda_utils", lambda: cuda_utils(build=False))
        for kernel in kernels:
            lookup("__triton_launcher", lambda: launcher(kernel, build=False))
    return list(found.values())
