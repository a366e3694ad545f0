"""CUDA: the offline (target-only) and device build targets, and the C modules Triton builds at first launch.

- :class:`CudaOfflineTarget`: no GPU. Installs a target-only driver, so Triton compiles for ``sm_XX`` without
  libcuda, and builds with the host C compiler the C modules Triton builds at a node's first launch: ``cuda_utils.so``
  and, on a Triton that builds one per kernel signature (3.6), each kernel's launcher (:func:`build_modules`).
  Autotune results cannot be measured here (nothing to benchmark on): build writes them from an autotune table
  measured on one device (prewarm.building.autotune).
- :class:`CudaDeviceTarget`: a real GPU. Compiles the same way, then runs each provider's ``run(spec, device)``
  once so autotune results and launchers land in the cache dir too.
- :func:`probe_modules`: are a plan's launchers and ``cuda_utils`` in a cache dir (the driver's own classes asked).

What differs between Triton releases here is asked of ``tritoncompat.release()``: whether launchers are built per
kernel signature, and what ``cuda_utils``' key hashes (3.8: the dirs libcuda.so.1 is found in, so a build names the
node's: ``[target] libcuda_dirs``, default :data:`NODE_LIBCUDA_DIRS`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ... import devices
from .. import tritoncompat
from ...errors import BuildError, EnvironmentProblem, ManifestError
from ...planning.plan import resolve
from .target import Target


# Where a node's libcuda.so.1 is, as its Triton finds it (`ldconfig -p`), unless the manifest names other dirs
# ([target] libcuda_dirs): the NVIDIA Container Toolkit mounts the driver's libraries into the image's own library
# dir, /usr/lib/x86_64-linux-gnu on Debian and Ubuntu based x86_64 images (the CUDA, PyTorch, sglang and vLLM images)
NODE_LIBCUDA_DIRS = ("/usr/lib/x86_64-linux-gnu",)


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
class CudaTarget(Target):
    """What both CUDA targets know of the nodes besides the GPU: where their libcuda.so.1 is."""

    libcuda_dirs: tuple[str, ...] = field(default=NODE_LIBCUDA_DIRS)  # [target] libcuda_dirs


@dataclass
class CudaOfflineTarget(CudaTarget):
    """CUDA without a GPU: the real compiler pipeline down to cubin, through a target-only driver."""

    mode: ClassVar[str] = "offline"

    def activate(self) -> None:
        activate_offline(self.arch, self.device_profile)

    def compile(self, fn: Any, specialization_data: str) -> Any:
        """Compile, then (3.6) build the kernel's launcher into the cache, here in the worker, in parallel; one that
        fails here is built again, or its failure named, by :meth:`after_build`."""
        kernel = super().compile(fn, specialization_data)
        if tritoncompat.release().cuda_launchers == "per-signature":
            with contextlib.suppress(Exception):  # counted and named by after_build (build_modules)
                launcher(kernel, build=True)
        return kernel

    def after_build(self, providers: list[Any], spec: dict, cache_dir: str, compiles: list) -> list[str]:
        return build_modules(compiles, cache_dir, self.libcuda_dirs)

    def notes(self) -> list[str]:
        return [
            "offline CUDA build: kernels and the C modules a node builds at first launch are in the cache, but no "
            "autotune results of its own: they come from the manifest's autotune table ([target] tuned or --tuned, made by "
            "`prewarm tune` on one device); a tuning key it lacks is benchmarked once per process on the node"
        ]


@dataclass
class CudaDeviceTarget(CudaTarget):
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

    def after_build(self, providers: list[Any], spec: dict, cache_dir: str, compiles: list) -> list[str]:
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
# Triton builds cuda_utils once, and (3.6) a C launcher per kernel signature, with the host C compiler at first
# launch, keyed by their source and the platform (3.8: also by the build config, libcuda's dirs among it), not by
# the GPU: built here they are found on the node, which then needs no compiler and spends no time in it. Linking
# needs libcuda.so.1; without the NVIDIA driver the device profile's stand-in (every entry point, each answering
# no device) serves the link only (the cu* symbols resolve against the node's libcuda at load time).


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
    wrapper that links it."""
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
    # driver does. -L: where the dirs Triton passes are the node's (3.8), which this host need not have
    Path(stub, "cc").write_text(f'#!/bin/sh\nexec "{cc}" -Wl,--no-as-needed "$@" "-L{stub}"\n')
    os.chmod(os.path.join(stub, "cc"), 0o755)
    return stub


@contextlib.contextmanager
def _libcuda(link: bool, node_dirs: tuple[str, ...] | None = None):
    """``libcuda.so.1`` as Triton's driver classes need it: they assert that it exists before anything else, and
    building links against it. ``node_dirs``: Triton's ``libcuda_dirs()`` answers these (the dirs a node finds it
    in, which 3.8 keys cuda_utils by); else, where the driver is not installed, a stand-in is used (see
    ``_libcuda_stub``)."""
    import shutil

    from triton.backends.nvidia import driver as nv

    if node_dirs is None and _driver_installed():  # look up and link against the real driver
        yield
        return
    cc = None
    if link:
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")  # as Triton's build picks it
        if cc is None:
            raise RuntimeError("no C compiler (gcc, clang or $CC) to build launchers with")
    stub = _libcuda_stub(cc)
    saved = nv.libcuda_dirs
    # both read at use (3.8 caches $CC: forgotten around the block), and neither is one of the cache key's env vars
    with tritoncompat.restored_env("TRITON_LIBCUDA_PATH", "CC"), _compiler_read_anew():
        os.environ["TRITON_LIBCUDA_PATH"] = stub
        if link:
            os.environ["CC"] = os.path.join(stub, "cc")
        if node_dirs is not None:
            nv.libcuda_dirs = lambda: list(node_dirs)  # library_dirs() calls it by its module global
        else:
            nv.libcuda_dirs.cache_clear()
        nv.library_dirs.cache_clear()
        try:
            yield
        finally:
            nv.libcuda_dirs = saved
            nv.libcuda_dirs.cache_clear()
            nv.library_dirs.cache_clear()


@contextlib.contextmanager
def _compiler_read_anew():
    """Within the block, and after it, Triton's C builds read $CC as it is then (3.8 caches what it read first)."""
    if not tritoncompat.release().caches_c_compiler:
        yield
        return
    import triton.runtime.build as tb

    tb._find_compiler.cache_clear()
    try:
        yield
    finally:
        tb._find_compiler.cache_clear()


class _Unloaded(types.ModuleType):
    """Stands in for a built module that is not loaded (that needs the NVIDIA driver): every attribute is None."""

    def __getattr__(self, name):
        return None


@contextlib.contextmanager
def _build_without_loading(node_dirs: tuple[str, ...] | None):
    """Triton builds a missing module into the cache, then imports it; here the import is skipped, so a module
    already in the cache is left as is (an import failure would rebuild it)."""
    import triton.runtime.build as tb

    saved = tb._load_module_from_path
    tb._load_module_from_path = lambda name, path: _Unloaded(name)
    try:
        with _libcuda(link=True, node_dirs=node_dirs):
            yield
    finally:
        tb._load_module_from_path = saved


def _triton_dir() -> str:
    """The installed triton package's dir (3.8 keys cuda_utils by its backends/nvidia/include and lib)."""
    import triton

    return os.path.dirname(triton.__file__)


def _keyed_by_libcuda() -> bool:
    """Does this Triton's cuda_utils key hash the dirs libcuda.so.1 is found in (3.8)?"""
    return "library_dirs" in tritoncompat.release().cuda_utils_key


def launcher(kernel, build: bool) -> None:
    """The launcher ``.so`` of a compiled kernel (``preload``'s result) as a Triton that builds one per kernel
    signature (3.6) makes it at first launch: built into the active cache dir (``build``), or only looked up (the
    active cache manager sees the lookup)."""
    from triton.backends.nvidia.driver import CudaLauncher

    with _build_without_loading(None) if build else _libcuda(link=False):
        CudaLauncher(kernel.src, kernel.metadata)


def cuda_utils(build: bool, node_dirs: tuple[str, ...] | None = None) -> None:
    """``cuda_utils.so``, what the CUDA driver builds when a process first uses it: built or looked up, as above;
    ``node_dirs``: keyed as on a node whose libcuda.so.1 is there (3.8), else as this host's Triton keys it."""
    from triton.backends.nvidia import driver as nv

    saved = {name: getattr(nv, name, None) for name in ("PyCUtensorMap", "PyKernelArg", "ARG_CONSTEXPR",
                                                       "ARG_KERNEL", "ARG_TUPLE")}  # CudaUtils() sets these globals
    try:
        with _build_without_loading(node_dirs) if build else _libcuda(link=False, node_dirs=node_dirs):
            nv.CudaUtils.__init__(object.__new__(nv.CudaUtils))  # not the driver's singleton instance
    finally:
        for name, value in saved.items():
            setattr(nv, name, value)


def build_modules(compiles: list, cache_dir: str, libcuda_dirs: tuple[str, ...]) -> list[str]:
    """Build into ``cache_dir`` (after every planned compile is in it) the C modules a node's Triton builds at first
    launch: cuda_utils (3.8: keyed for nodes whose libcuda.so.1 is in ``libcuda_dirs``) and (3.6) each kernel's
    launcher. What was built, and what could not be (named), as build report notes."""
    release = tritoncompat.release()
    node_dirs = tuple(libcuda_dirs) if _keyed_by_libcuda() else None
    runs = [("cuda_utils", lambda: cuda_utils(build=True, node_dirs=node_dirs))]
    if release.cuda_launchers == "per-signature":
        from ..probe import ReadOnlyCacheManager

        with tritoncompat.cache_scope(os.path.abspath(cache_dir), ReadOnlyCacheManager):
            kernels = [tritoncompat.load_compiled(resolve(c.kernel), c.specialization) for c in compiles]
        runs += [("__triton_launcher", lambda k=k: launcher(k, build=True)) for k in kernels]
    failed = []
    with tritoncompat.cache_scope(os.path.abspath(cache_dir)):
        for name, run in runs:
            try:
                run()
            except Exception as e:  # noqa: BLE001  (each named below; the node builds it at first launch)
                failed.append(f"{name}: {type(e).__name__}: {e}")
    where = (f"; keyed for nodes whose libcuda.so.1 is in {':'.join(node_dirs)} ([target] libcuda_dirs) and whose "
             f"triton is installed at {_triton_dir()} as here "
             f"({release} keys cuda_utils by both)" if node_dirs else "")
    launchers = (f"the launchers of {len(runs) - 1} kernels (a module per kernel signature)"
                 if release.cuda_launchers == "per-signature"
                 else f"no launcher per kernel signature: not needed on {release} (every kernel launches through "
                      f"cuda_utils' launch)")
    if failed:
        return [f"launchers and cuda_utils.so were not built ({len(failed)} of {len(runs)} C modules; first: "
                f"{failed[0]}); the node builds them at first launch, which needs a C compiler there{where}"]
    return [f"C modules a node builds at first launch, built here: cuda_utils.so{where}; {launchers}"]


def probe_modules(target: CudaTarget, compiles: list, results: list, cache_dir: str) -> list:
    """For every planned compile that hits (``results``: prewarm.building.probe's), is its launcher in ``cache_dir``
    (3.6), and is cuda_utils, keyed as this node's Triton keys it? One ``ModuleResult`` per module key; a cuda_utils
    lookup on a host without the NVIDIA driver (3.8) is keyed for ``target.libcuda_dirs``, and says so."""
    from ..probe import ModuleResult, Probe, ProbeCacheManager, ReadOnlyCacheManager

    root = os.path.realpath(cache_dir)
    per_signature = tritoncompat.release().cuda_launchers == "per-signature"
    kernels = []
    if per_signature:
        with tritoncompat.cache_scope(os.path.abspath(cache_dir), ReadOnlyCacheManager):
            kernels = [tritoncompat.load_compiled(resolve(c.kernel), c.specialization)
                       for c, r in zip(compiles, results) if r.hit]  # disk hits: loaded, nothing compiled
    found: dict[str, ModuleResult] = {}

    def key_of(run) -> tuple[str, str]:
        try:
            run()
        except Probe as p:
            return p.key, p.filename
        raise RuntimeError("the driver's class looked nothing up")  # a ProbeCacheManager is in scope

    def lookup(name: str, run, detail: str = "") -> ModuleResult:
        key, filename = key_of(run)
        m = found.setdefault(key, ModuleResult(name, key, os.path.isfile(os.path.join(root, key, filename)), 0,
                                               detail))
        m.kernels += name != "cuda_utils"
        return m

    with tritoncompat.cache_scope(os.path.abspath(cache_dir), ProbeCacheManager):
        if not _keyed_by_libcuda():
            lookup("cuda_utils", lambda: cuda_utils(build=False))
        elif not _driver_installed():
            lookup("cuda_utils", lambda: cuda_utils(build=False, node_dirs=target.libcuda_dirs),
                   f"no NVIDIA driver here: looked up as a node whose libcuda.so.1 is in "
                   f"{':'.join(target.libcuda_dirs)} ([target] libcuda_dirs) would")
        else:
            m = lookup("cuda_utils", lambda: cuda_utils(build=False))
            if not m.present:
                m.detail = _libcuda_miss(key_of, root, target.libcuda_dirs)
        for kernel in kernels:
            lookup("__triton_launcher", lambda: launcher(kernel, build=False))
    return list(found.values())


def _libcuda_miss(key_of, root: str, built_for: tuple[str, ...]) -> str:
    """Why this node's cuda_utils key (3.8) is not in the cache: its libcuda dirs are not the ones it was built for
    (both named), or neither key is there."""
    from triton.backends.nvidia import driver as nv

    here = ":".join(nv.libcuda_dirs())
    key, filename = key_of(lambda: cuda_utils(build=False, node_dirs=built_for))
    if os.path.isfile(os.path.join(root, key, filename)):
        return (f"the cache's cuda_utils was built for libcuda.so.1 in {':'.join(built_for)} ([target] "
                f"libcuda_dirs), this node's Triton finds it in {here}: rebuild with [target] libcuda_dirs = "
                f"{list(nv.libcuda_dirs())!r}")
    return (f"keyed here by libcuda.so.1 in {here} and the triton install at "
            f"{_triton_dir()}; the cache has no cuda_utils for "
            f"these nor for [target] libcuda_dirs {':'.join(built_for)} (built by a triton installed elsewhere?)")
