"""The running Triton, as each version spells it: its distribution and key, its cache dir, cache manager and JIT
cache hook, its driver, a kernel's JITFunction, warming up and preloading a compile, and the one-time work of a
process's first launch."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading

from .releases import release


@functools.lru_cache()
def triton_key() -> str:
    """Triton's own version+source digest, the first part of every cache key (sha256 of it, for brevity)."""
    if release().knobs:
        from triton.runtime.cache import triton_key as key
    else:
        from triton.compiler.compiler import triton_key as key
    return hashlib.sha256(key().encode()).hexdigest()


def start_process_warmup() -> threading.Thread:
    """Do now, in a daemon thread, the one-time work Triton does at a process's first kernel launch that no cache
    holds (most of a process's first step: bench/offline_autotune.py --profile): its own key (its sources and
    libtriton hashed) and the modules its native specializer imports at the first launch (3.6: gluon's hopper
    TensorDescriptor). hashlib and file reads release the GIL; a launch
    that comes first waits for the key being computed instead of hashing it a second time (:func:`_one_key`). A
    failure here is left for the launch path to meet and report."""
    import importlib

    _one_key()

    def warm():
        for name in ("triton.tools.tensor_descriptor", "triton.experimental.gluon.nvidia.hopper"):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  (not in this Triton: nothing to warm)
                pass
        try:
            triton_key()
        except Exception:  # noqa: BLE001
            pass

    thread = threading.Thread(target=warm, name="prewarm-triton-warmup", daemon=True)
    thread.start()
    return thread


def _one_key() -> None:
    """Triton's ``triton_key`` (lru_cached, no lock) behind a lock, in every Triton module that holds it, so that
    concurrent first calls wait for one computation: the value and the function Triton calls are Triton's own."""
    import sys

    if release().knobs:
        from triton.runtime import cache as home
    else:
        from triton.compiler import compiler as home
    original = getattr(home, "triton_key", None)
    if original is None or getattr(original, "_prewarm_one", False):
        return
    lock = threading.Lock()

    @functools.wraps(original)
    def one_key():
        with lock:
            return original()

    one_key._prewarm_one = True
    one_key.cache_info, one_key.cache_clear = original.cache_info, original.cache_clear
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("triton") and getattr(module, "triton_key", None) is original:
            module.triton_key = one_key


def cache_key_text(src, backend, options, env_vars: dict) -> str:
    """compile()'s key text, which it hashes into the key (3.2: inline in compiler.py; 3.4+: runtime/cache.py
    get_cache_key, same text)."""
    if release().knobs:
        from triton.runtime.cache import get_cache_key

        return get_cache_key(src, backend, options, env_vars=env_vars)
    from triton.compiler.compiler import triton_key

    return f"{triton_key()}-{src.hash()}-{backend.hash()}-{options.hash()}-{str(sorted(env_vars.items()))}"


def cache_invalidating_env_vars() -> dict[str, str]:
    """The env vars Triton folds into its key, as Triton itself reads them now (set ones only)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars  # same name in 3.2 (triton-ascend) and 3.4+

    return dict(get_cache_invalidating_env_vars())


def ptxas_path() -> str:
    """The ptxas Triton's CUDA backend runs (TRITON_PTXAS_PATH, else the one in its wheel)."""
    if release().knobs:
        from triton import knobs

        return knobs.nvidia.ptxas.path
    from triton.backends.nvidia.compiler import _path_to_binary  # (path, version)

    return _path_to_binary("ptxas")[0]


def cache_dir() -> str:
    """The directory Triton reads and writes now (TRITON_CACHE_DIR or its default)."""
    if release().knobs:
        from triton import knobs

        return knobs.cache.dir
    from triton.runtime.cache import default_cache_dir

    return os.getenv("TRITON_CACHE_DIR", "").strip() or default_cache_dir()


def set_cache_dir(path: str) -> None:
    """Point this process's Triton at ``path`` (env for 3.2 and child processes; the knob for 3.4+)."""
    os.environ["TRITON_CACHE_DIR"] = path
    if release().knobs:
        from triton import knobs

        knobs.cache.dir = path


def set_cache_manager(cls: type | None) -> None:
    """Install a FileCacheManager subclass for this process (None restores Triton's default)."""
    if release().knobs:
        from triton import knobs

        knobs.cache.manager_class = cls
    else:  # 3.2 reads the env var at every get_cache_manager() call
        if cls is None:
            os.environ.pop("TRITON_CACHE_MANAGER", None)
        else:
            os.environ["TRITON_CACHE_MANAGER"] = f"{cls.__module__}:{cls.__qualname__}"


def cache_manager_class() -> type | None:
    """The cache manager class this process's Triton uses now (3.4+: the knob's, else FileCacheManager); None on
    3.2, which imports TRITON_CACHE_MANAGER by name at every lookup."""
    if not release().knobs:
        return None
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    return knobs.cache.manager_class or FileCacheManager


def get_jit_cache_hook():
    if release().knobs:
        from triton import knobs

        return knobs.runtime.jit_cache_hook
    from triton.runtime.jit import JITFunction

    return JITFunction.cache_hook


def set_jit_cache_hook(hook) -> None:
    """The hook Triton calls with every compile request's specialization data (a truthy return skips it)."""
    if release().knobs:
        from triton import knobs

        knobs.runtime.jit_cache_hook = hook
    else:
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


def chosen_driver():
    """The driver Triton was given or has made, without making one (None: none yet; making one probes the device)."""
    from triton.runtime.driver import driver

    if release().knobs:
        return driver._active
    current = driver.active  # 3.2: a LazyProxy until first used
    return current._obj if type(current).__name__ == "LazyProxy" else current


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
    """``kernel.warmup`` through any wrapper stack. Heuristics' values are applied here, as their ``run`` does:
    over an Autotuner, ``run`` would benchmark (the Autotuner's own ``warmup``, every config, is called instead),
    and triton 3.2's Heuristics has no ``warmup`` at all."""
    from triton.runtime.autotuner import Heuristics

    if isinstance(kernel, Heuristics):
        kwargs = dict(kwargs)
        named = dict(zip(kernel.arg_names, args))
        for name, heur in kernel.values.items():
            kwargs[name] = heur({**named, **kwargs})
        return warmup(kernel.fn, args, kwargs, grid)
    kernel.warmup(*args, grid=grid, **kwargs)


def preload(fn, specialization_data: str):
    """Compile (or find on disk) exactly the request recorded in ``specialization_data``."""
    return jit_function(fn).preload(specialization_data)


def load_compiled(fn, specialization_data: str):
    """``preload`` that leaves nothing in the JITFunction's in-memory kernel cache (3.4+), so that a later plan or
    warmup in this process still reaches the compiler: for reading what a cache holds."""
    from triton.runtime.driver import driver

    jit = jit_function(fn)
    device = driver.active.get_current_device()
    cache = jit.device_caches[device][0] if release().knobs else jit.cache[device]
    before = set(cache)
    try:
        return jit.preload(specialization_data)
    finally:
        for key in set(cache) - before:
            del cache[key]


def mock_tensor(dtype, shape):
    """A stand-in tensor for warmup: dtype and shape only, 16-byte aligned pointer (as Triton's own warmup)."""
    from triton.runtime.jit import MockTensor

    return MockTensor(dtype, list(shape)) if release().knobs else MockTensor(dtype)


@contextlib.contextmanager
def cache_scope(path: str, manager: type | None = None):
    """Within the block Triton uses cache dir ``path`` and cache manager ``manager``; both restored after."""
    if release().knobs:
        from triton import knobs

        scope = knobs.cache.scope()
    else:
        scope = contextlib.nullcontext()
    with restored_env("TRITON_CACHE_DIR", "TRITON_CACHE_MANAGER"), scope:
        set_cache_dir(path)
        set_cache_manager(manager)
        yield


@contextlib.contextmanager
def restored_env(*names: str):
    """The environment variables ``names`` as they were before the block, whatever it set."""
    saved = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
