"""The Triton releases prewarm supports, one :class:`Release` each, stating what that release does that prewarm
depends on; :func:`release` picks the installed one by its version, and :func:`require_supported` refuses any other
by name (the CLI calls it before any work). The concern modules (runtime, autotune, specialization, cachekey,
ascend) and the backends ask the release object instead of probing Triton's modules."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ...errors import EnvironmentProblem

# what cuda_utils' cache key hashes (runtime/build.py): 3.6 its C source and the platform; 3.8 also the build config,
# whose library_dirs are the triton install's backends/nvidia/lib and the dirs libcuda.so.1 is found in
# (TRITON_LIBCUDA_PATH, else `ldconfig -p`, else LD_LIBRARY_PATH) and whose include_dirs the install's
# backends/nvidia/include
_SOURCE_AND_PLATFORM = ("source", "platform")
_WITH_BUILD_CONFIG = (*_SOURCE_AND_PLATFORM, "language", "library_dirs", "include_dirs", "libraries")


@dataclass(frozen=True)
class Release:
    """One supported Triton release (a distribution's major.minor series) and how it behaves where prewarm
    depends on it."""

    distribution: str  # "triton" | "triton-ascend"
    series: tuple[int, int]
    # 3.4+ spelling: triton.knobs (cache dir and manager, jit_cache_hook, ptxas), runtime/cache.py's triton_key and
    # get_cache_key, JITFunction.device_caches, MockTensor(dtype, shape), constexpr globals folded into cache_key.
    # 3.2: env vars, JITFunction.cache_hook and .cache, compiler.py's triton_key, MockTensor(dtype)
    knobs: bool
    # CUDA: "per-signature": a C launcher .so built per kernel signature at first launch (3.6); "generic": none,
    # every kernel launches through cuda_utils' ``launch`` (3.8); "": no CUDA backend
    cuda_launchers: str = ""
    cuda_utils_key: tuple[str, ...] = ()  # what cuda_utils' cache key hashes (CUDA)
    # preload turns the constants' lists back into tuples and {"jit_function": "module:qualname"} into that
    # JITFunction (3.8; its specialization data also names its target, and preload refuses another)
    restores_constants: bool = False
    # the specialization's attrs name every parameter, [] for a constexpr (3.8; 3.6: constexprs have none); compile()
    # hashes str(attrs) into the key, so a request rewritten to another int class must say it the same way
    attrs_for_constexprs: bool = False
    # runtime/build.py reads $CC once per process (_find_compiler, cached; 3.8) instead of at every C build (3.6)
    caches_c_compiler: bool = False

    def __str__(self) -> str:
        return f"{self.distribution} {self.series[0]}.{self.series[1]}"


RELEASES = (
    Release("triton", (3, 6), knobs=True, cuda_launchers="per-signature", cuda_utils_key=_SOURCE_AND_PLATFORM),
    Release("triton", (3, 8), knobs=True, cuda_launchers="generic", cuda_utils_key=_WITH_BUILD_CONFIG,
            restores_constants=True, attrs_for_constexprs=True, caches_c_compiler=True),
    # triton-ascend's own differences, by layout: tritoncompat.ascend (3.5 read from its main branch's source, never
    # run: the registry has 3.2 only)
    Release("triton-ascend", (3, 2), knobs=False),
    Release("triton-ascend", (3, 5), knobs=True),
)


@functools.lru_cache()
def triton_distribution() -> tuple[str, str]:
    """(distribution name, version) of whatever provides the `triton` module: `triton` or `triton-ascend`.

    The two known names are asked first (cheap); scanning every installed distribution is slow for a pre-launch job
    and is left for other builds (pytorch-triton-rocm, nightlies...).
    """
    import importlib.metadata  # here: a repeated install compares fingerprints without it (prewarm.shipping.nodestamp)

    def candidates():
        yield from ("triton-ascend", "triton")
        yield from importlib.metadata.packages_distributions().get("triton", [])

    for dist in candidates():
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    import triton

    return "unknown", triton.__version__


def version_series(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ("3.8.0", "3.6.0+git1234"); None where it has no such form."""
    numbers = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(numbers[1]), int(numbers[2])) if numbers else None


def find(distribution: str, version: str) -> Release | None:
    """The supported release ``distribution`` ``version`` belongs to (None: not one prewarm supports)."""
    wanted = version_series(version)
    return next((r for r in RELEASES if r.distribution == distribution and r.series == wanted), None)


def supported_text() -> str:
    return ", ".join(str(r) for r in RELEASES)


@functools.lru_cache()
def release() -> Release:
    """The installed Triton's release; an unsupported one raises EnvironmentProblem naming it and the supported
    ones."""
    dist, version = triton_distribution()
    found = find(dist, version)
    if found is None:
        raise EnvironmentProblem(f"the installed Triton is {dist} {version}, which this prewarm does not support "
                                 f"(supported: {supported_text()}): install one of those beside the server, or a "
                                 f"prewarm that supports {dist} {version}")
    return found


def differs_from(series: tuple[str, ...], what: str) -> str | None:
    """A sentence where the installed Triton is not of one of ``series`` ("3.8", ...), which ``what`` is for; None
    where it is, or where ``series`` names none."""
    here = release()
    if not series or f"{here.series[0]}.{here.series[1]}" in series:
        return None
    return f"{what} is for Triton {' or '.join(series)}; this is {here}"


def require_supported() -> None:
    """Refuse, before any work, a process whose installed Triton is not a supported release (nothing where no
    Triton is installed: the verbs that need one say so themselves)."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        release()
