"""Everything that differs between triton 3.2 (triton-ascend 3.2.0) and triton 3.4+ (upstream 3.6), in one place."""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os


@functools.lru_cache()
def triton_distribution() -> tuple[str, str]:
    """(distribution name, version) of whatever provides the `triton` module: `triton` or `triton-ascend`.

    The two known names are asked first (milliseconds); scanning every installed distribution costs ~0.6 s of a
    pre-launch job and is left for other builds (pytorch-triton-rocm, nightlies...).
    """
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
    from triton._C.libtriton import get_cache_invalidating_env_vars  # same name in 3.2 (triton-ascend) and 3.4+

    return dict(get_cache_invalidating_env_vars())


def cache_dir() -> str:
    """The directory Triton reads and writes now (TRITON_CACHE_DIR or its default)."""
    try:
        from triton import knobs  # 3.4+

        return knobs.cache.dir
    except ImportError:
        from triton.runtime.cache import default_cache_dir  # 3.2

        return os.getenv("TRITON_CACHE_DIR", "").strip() or default_cache_dir()


def set_cache_dir(path: str) -> None:
    """Point this process's Triton at ``path`` (env for 3.2 and child processes; the knob for 3.4+)."""
    os.environ["TRITON_CACHE_DIR"] = path
    try:
        from triton import knobs

        knobs.cache.dir = path
    except ImportError:
        pass


def set_cache_manager(cls: type | None) -> None:
    """Install a FileCacheManager subclass for this process (None restores Triton's default)."""
    try:
        from triton import knobs  # 3.4+

        knobs.cache.manager_class = cls
    except ImportError:  # 3.2 reads the env var at every get_cache_manager() call
        if cls is None:
            os.environ.pop("TRITON_CACHE_MANAGER", None)
        else:
            os.environ["TRITON_CACHE_MANAGER"] = f"{cls.__module__}:{cls.__qualname__}"


def get_jit_cache_hook():
    try:
        from triton import knobs

        return knobs.runtime.jit_cache_hook
    except ImportError:
        from triton.runtime.jit import JITFunction

        return JITFunction.cache_hook


def set_jit_cache_hook(hook) -> None:
    """The hook Triton calls with every compile request's specialization data (a truthy return skips it)."""
    try:
        from triton import knobs

        knobs.runtime.jit_cache_hook = hook
    except ImportError:
        from triton.runtime.jit import JITFunction

        JITFunction.cache_hook = hook


@contextlib.contextmanager
def compile_requests(skip: bool):
    """Collect the specialization data of every compile request made inside; ``skip``: Triton compiles none."""
    captured: list[str] = []
    previous = get_jit_cache_hook()

    def hook(*, compile, **_):
        captured.append(compile["specialization_data"])
        return skip

    set_jit_cache_hook(hook)
    try:
        yield captured
    finally:
        set_jit_cache_hook(previous)


def jit_function(obj):
    """The JITFunction under any stack of Autotuner / Heuristics wrappers."""
    from triton.runtime.jit import JITFunction

    seen = obj
    while not isinstance(seen, JITFunction):
        inner = getattr(seen, "fn", None)
        if inner is None:
            raise TypeError(f"{obj!r} is not a Triton kernel (no JITFunction under it)")
        seen = inner
    return seen


def kernel_ref(obj) -> str:
    """"module:qualname" of the Python function a kernel (or its wrappers) was made from."""
    fn = jit_function(obj).fn
    return f"{fn.__module__}:{fn.__qualname__}"


def warmup(kernel, args: tuple, kwargs: dict, grid) -> None:
    """``kernel.warmup`` through any wrapper stack. Heuristics over an Autotuner would benchmark in ``run``, so
    its values are applied here and the Autotuner's own ``warmup`` (every config) is called instead."""
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, Heuristics) and not isinstance(kernel.fn, JITFunction):
        kwargs = dict(kwargs)
        named = dict(zip(kernel.arg_names, args))
        for name, heur in kernel.values.items():
            kwargs[name] = heur({**named, **kwargs})
        return warmup(kernel.fn, args, kwargs, grid)
    kernel.warmup(*args, grid=grid, **kwargs)


def autotuned_call(kernel, args: tuple, kwargs: dict):
    """(Autotuner, args, kwargs) as the Autotuner's ``run`` receives them for this call, or None when the call is
    not autotuned or the Autotuner keeps no results on disk (triton 3.2 has no ``cache_results``; 3.4+ only with
    ``cache_results=True`` or TRITON_CACHE_AUTOTUNING=1). Heuristics over the Autotuner are applied first, as
    their ``run`` would."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    if isinstance(kernel, Heuristics) and isinstance(kernel.fn, Autotuner):
        named = {**dict(zip(kernel.arg_names, args)), **kwargs}
        kwargs = {**kwargs, **{name: heur(named) for name, heur in kernel.values.items()}}
        kernel = kernel.fn
    if not isinstance(kernel, Autotuner) or not getattr(kernel, "cache_results", False):
        return None
    return kernel, args, kwargs


def preload(fn, specialization_data: str):
    """Compile (or find on disk) exactly the request recorded in ``specialization_data``."""
    return jit_function(fn).preload(specialization_data)


def mock_tensor(dtype, shape):
    """A stand-in tensor for warmup: dtype and shape only, 16-byte aligned pointer (as Triton's own warmup)."""
    import inspect

    from triton.runtime.jit import MockTensor

    if len(inspect.signature(MockTensor).parameters) == 1:  # 3.2 (triton-ascend): MockTensor(dtype)
        return MockTensor(dtype)
    return MockTensor(dtype, list(shape))


@contextlib.contextmanager
def cache_scope(path: str, manager: type | None = None):
    """Within the block Triton uses cache dir ``path`` and cache manager ``manager``; both restored after."""
    saved = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_CACHE_MANAGER")}
    try:
        from triton import knobs

        scope = knobs.cache.scope()
    except ImportError:
        scope = contextlib.nullcontext()
    try:
        with scope:
            set_cache_dir(path)
            set_cache_manager(manager)
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
