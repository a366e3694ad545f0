"""Everything that differs between triton 3.2 (triton-ascend 3.2.0) and triton 3.4+ (upstream 3.6), in one place."""
from __future__ import annotations

import functools
import importlib.metadata
import os


@functools.lru_cache()
def triton_distribution() -> tuple[str, str]:
    """(distribution name, version) of whatever provides the `triton` module: `triton` or `triton-ascend`."""
    for dist in importlib.metadata.packages_distributions().get("triton", []):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    import triton

    return "unknown", triton.__version__


@functools.lru_cache()
def triton_key() -> str:
    """Triton's own version+source digest, the first part of every cache key (sha256 of it, for brevity)."""
    import hashlib

    try:
        from triton.runtime.cache import triton_key as key  # 3.4+
    except ImportError:
        from triton.compiler.compiler import triton_key as key  # 3.2
    return hashlib.sha256(key().encode()).hexdigest()


def cache_invalidating_env_vars() -> dict[str, str]:
    """The env vars Triton folds into its key, as Triton itself reads them now (set ones only)."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars  # 3.4+

        return dict(get_cache_invalidating_env_vars())
    except ImportError:
        from triton.compiler.compiler import get_env_vars  # 3.2 (name of the helper in that release)

        return dict(get_env_vars())
