"""Everything that differs between triton 3.2 (triton-ascend 3.2.0) and triton 3.4+ (upstream 3.6), in one place."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


@functools.lru_cache()
def triton_key() -> str:
    """Triton's own version+source digest, the first part of every cache key (sha256 of it, for brevity)."""
    try:
        from triton.runtime.cache import triton_key as key  # 3.4+
    except ImportError:
        from triton.compiler.compiler import triton_key as key  # 3.2
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

    try:
        from triton.runtime import cache as home  # 3.4+
    except ImportError:
        from triton.compiler import compiler as home  # 3.2
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


def cache_invalidating_env_vars() -> dict[str, str]:
    """The env vars Triton folds into its key, as Triton itself reads them now (set ones only)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars  # same name in 3.2 (triton-ascend) and 3.4+

    return dict(get_cache_invalidating_env_vars())


def ptxas_path() -> str:
    """The ptxas Triton's CUDA backend runs (TRITON_PTXAS_PATH, else the one in its wheel)."""
    try:
        from triton import knobs  # 3.4+

        return knobs.nvidia.ptxas.path
    except ImportError:
        from triton.backends.nvidia.compiler import _path_to_binary  # 3.2: (path, version)

        return _path_to_binary("ptxas")[0]


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


def cache_manager_class() -> type | None:
    """The cache manager class this process's Triton uses now (3.4+: the knob's, else FileCacheManager); None on
    3.2, which imports TRITON_CACHE_MANAGER by name at every lookup."""
    try:
        from triton import knobs
    except ImportError:
        return None
    from triton.runtime.cache import FileCacheManager

    return knobs.cache.manager_class or FileCacheManager


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


def chosen_driver():
    """The driver Triton was given or has made, without making one (None: none yet; making one probes the device)."""
    from triton.runtime.driver import driver

    if hasattr(driver, "_active"):  # 3.4+
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


def autotuned_call(kernel, args: tuple, kwargs: dict):
    """(Autotuner, args, kwargs) as the Autotuner's ``run`` receives them for this call, or None when the call is
    not autotuned or this Triton cannot keep autotune results on disk (3.2, triton-ascend: no ``cache_results``).
    Heuristics over the Autotuner are applied first, as their ``run`` would. Whether this process's Autotuner
    reads kept results is :func:`keeps_results`."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    if isinstance(kernel, Heuristics) and isinstance(kernel.fn, Autotuner):
        named = {**dict(zip(kernel.arg_names, args)), **kwargs}
        kwargs = {**kwargs, **{name: heur(named) for name, heur in kernel.values.items()}}
        kernel = kernel.fn
    if not isinstance(kernel, Autotuner) or not hasattr(kernel, "check_disk_cache"):
        return None
    return kernel, args, kwargs


def find_autotuner(kernel):
    """The Autotuner in ``kernel``'s stack of wrappers (Heuristics, Autotuner), on any Triton; None: there is none."""
    from triton.runtime.autotuner import Autotuner

    while not isinstance(kernel, Autotuner) and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel if isinstance(kernel, Autotuner) else None


def autotuner_of(kernel):
    """The Autotuner in ``kernel``'s stack of wrappers (Heuristics, Autotuner), or None: there is none, or this
    Triton cannot keep its results on disk (3.2, triton-ascend: no ``check_disk_cache``)."""
    tuner = find_autotuner(kernel)
    return tuner if tuner is not None and can_keep_results(tuner) else None


def can_keep_results(tuner) -> bool:
    """Does this Triton's Autotuner have a result cache at all (3.4+: ``check_disk_cache``; triton-ascend 3.2: no,
    it keeps its winners in memory, per process)?"""
    return hasattr(tuner, "check_disk_cache")


def with_configs(kernel, configs: list):
    """A copy of ``kernel``'s wrapper stack whose Autotuner has ``configs`` and nothing in memory (the kernel itself
    untouched): what a pinned Autotuner runs, for planning. An Autotuner with one config runs it without
    benchmarking, on every Triton."""
    import copy

    from triton.runtime.autotuner import Autotuner

    out = copy.copy(kernel)
    if isinstance(kernel, Autotuner):
        out.configs, out.cache = list(configs), {}
    else:
        out.fn = with_configs(kernel.fn, configs)
    return out


_PIN_CHECKED = "_prewarm_pin_checked"


def pin_autotuners(choose) -> None:
    """From now on, each Autotuner of this process asks ``choose(tuner)`` once, at its first call, for the one
    config it is to run (None: it keeps its configs). A pinned Autotuner has that config alone, so it never
    benchmarks: on triton-ascend 3.2, which keeps no results, the only way a node serves without benchmarking.
    Installed on the Autotuner class (``run``), so Autotuners made before and after are covered alike."""
    from triton.runtime.autotuner import Autotuner

    run = Autotuner.run

    def pinned_run(self, *args, **kwargs):
        if not self.__dict__.get(_PIN_CHECKED):
            config = choose(self)
            if config is not None:
                self.configs = [config]
            self.__dict__[_PIN_CHECKED] = True
        return run(self, *args, **kwargs)

    Autotuner.run = pinned_run


def keeps_results(tuner) -> bool:
    """Does this Autotuner read and write ``<fn>.autotune.json``? Fixed when it was made (at its module's import):
    ``cache_results=True``, or TRITON_CACHE_AUTOTUNING=1 in the environment then."""
    return bool(getattr(tuner, "cache_results", False))


class NoBenchmark(Exception):
    """Raised in :func:`first_tuning`'s Autotuner when it would benchmark without asking the disk first."""


@dataclass
class Tuning:
    """What an Autotuner's first call computes before it asks the disk (see :func:`first_tuning`)."""

    key: tuple | None = None  # Triton's tuning key: the key arguments' values, then each tensor argument's dtype
    configs: list = field(default_factory=list)  # the configs it benchmarks, after its own pruning (prune/perf hooks)


class _AtLookup(Exception):
    """Stops :func:`tuning_of`'s copy where the Autotuner would look for a kept result."""


def _run_copy(tuner, args: tuple, kwargs: dict, seen: Tuning, look: bool) -> None:
    """A copy of Autotuner ``tuner`` runs this call as a fresh process's first call would (no result in memory)
    and keeping results on disk, as a node with TRITON_CACHE_AUTOTUNING=1 does: it computes its tuning key and
    prunes its configs (``seen`` gets both), then asks the cache manager for a kept result (``look``) or stops
    there. Benchmarking instead raises :class:`NoBenchmark`. (``cache``, ``_bench``, ``prune_configs`` and
    ``check_disk_cache(tuning_key, configs, bench_fn)`` are the Autotuner's internals; triton-ascend 3.2 has no
    ``check_disk_cache``: its copy stops where it would benchmark.)"""
    import copy

    def no_benchmark(*a, **k):
        raise NoBenchmark

    def check_disk_cache(tuning_key, configs, bench_fn):
        seen.key, seen.configs = tuning_key, list(configs)
        if not look:
            raise _AtLookup
        return type(tuner).check_disk_cache(probe_copy, tuning_key, configs, bench_fn)

    probe_copy = copy.copy(tuner)
    probe_copy.cache = {}
    probe_copy.cache_results = True
    probe_copy._bench = no_benchmark
    probe_copy.check_disk_cache = check_disk_cache
    if not can_keep_results(tuner):  # 3.2: no lookup; the key is what it asks its in-memory cache for, the pruned
        # configs what prune_configs returns, and benchmarking follows them (where there is no lookup to stop at)
        class Keys(dict):
            def __contains__(self, key):
                seen.key = key
                return False

        prune = probe_copy.prune_configs

        def pruned(*a, **k):
            seen.configs = list(prune(*a, **k))
            return seen.configs

        def at_benchmark(*a, **k):
            raise _AtLookup if not look and seen.key is not None else NoBenchmark

        probe_copy.cache, probe_copy.prune_configs, probe_copy._bench = Keys(), pruned, at_benchmark
    kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}  # a launch's own, replaced here
    probe_copy.run(*args, grid=(1,), warmup=True, **kwargs)


def first_tuning(tuner, args: tuple, kwargs: dict, seen: Tuning | None = None) -> None:
    """:func:`_run_copy` up to the cache manager's lookup of ``<fn>.autotune.json``, where a probing manager stops it
    (it raises; ``seen`` has the tuning key and pruned configs by then). A single config goes to the kernel's own
    lookup instead; configs with pre_hooks, or no tuning key, raise :class:`NoBenchmark`."""
    _run_copy(tuner, args, kwargs, seen if seen is not None else Tuning(), look=True)


def tuning_of(tuner, args: tuple, kwargs: dict) -> Tuning:
    """The tuning key and pruned configs of this call, computed by a copy of the Autotuner that stops before any
    lookup (nothing is created or read in the cache dir); a call that would not be tuned raises :class:`NoBenchmark`
    (configs with pre_hooks, no tuning key) or gives an empty :class:`Tuning` (a single config)."""
    seen = Tuning()
    try:
        _run_copy(tuner, args, kwargs, seen, look=False)
    except _AtLookup:
        pass
    return seen


def watch_autotune_benchmarks(before) -> None:
    """From now on, ``before(tuner, args, kwargs)`` runs each time an Autotuner of this process starts benchmarking
    its configs for one call (a tuning key it found neither in memory nor on disk), before the first config runs;
    what it raises stops the benchmark. Installed on the Autotuner class, once per callback (``_bench`` runs once per
    config with the same ``nargs`` dict of that call: the first one of a call is the start; the same on triton-ascend
    3.2, whose Autotuner benchmarks at every process's first call of each tuning key)."""
    from triton.runtime.autotuner import Autotuner

    bench = Autotuner._bench
    mark = f"_prewarm_watched_{id(before)}"  # the call this watcher last saw start (each watcher its own)

    def watched(self, *args, config, **kwargs):
        if getattr(self, mark, None) is not self.nargs:
            setattr(self, mark, self.nargs)
            before(self, args, kwargs)
        return bench(self, *args, config=config, **kwargs)

    Autotuner._bench = watched


def preload(fn, specialization_data: str):
    """Compile (or find on disk) exactly the request recorded in ``specialization_data``."""
    return jit_function(fn).preload(specialization_data)


def load_compiled(fn, specialization_data: str):
    """``preload`` that leaves nothing in the JITFunction's in-memory kernel cache (3.4+), so that a later plan or
    warmup in this process still reaches the compiler: for reading what a cache holds."""
    from triton.runtime.driver import driver

    jit = jit_function(fn)
    device = driver.active.get_current_device()
    cache = jit.device_caches[device][0] if hasattr(jit, "device_caches") else jit.cache[device]  # 3.2: .cache
    before = set(cache)
    try:
        return jit.preload(specialization_data)
    finally:
        for key in set(cache) - before:
            del cache[key]


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
    try:
        from triton import knobs

        scope = knobs.cache.scope()
    except ImportError:
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


# --- compile requests as data ------------------------------------------------------------------------------------
# The specialization data a jit_cache_hook receives (and ``preload`` takes) is laid out differently in 3.2 (constexprs
# keyed by name, attrs as argument indices) and 3.4+ (constants and attrs keyed by argument path); a key dir holds
# neither, only what compile() stored. Both become one :class:`Specialization` here, so comparing is version-free.


@dataclass(frozen=True)
class Arg:
    """One kernel argument as a compile request fixes it."""

    type: str  # "*bf16", "i32", "fp32"... or "constexpr"
    value: Any = None  # the value compiled in (constexprs, and int arguments Triton specialized to 1 or None)
    attrs: tuple = ()  # ((name, value), ...), e.g. (("tt.divisibility", 16),): an aligned pointer / int % 16 == 0

    def describe(self) -> str:
        """"*bf16 16-byte aligned", "i32 not divisible by 16", "= 64": dtype and specialization class."""
        if self.type == "constexpr":
            return f"= {self.value!r}"
        divisible = ("tt.divisibility", 16) in self.attrs
        if self.type.startswith("*"):
            return f"{self.type} {'16-byte aligned' if divisible else 'not 16-byte aligned'}"
        if self.type[:1] in "iu":
            return f"{self.type} {'divisible by 16' if divisible else 'not 1, not divisible by 16'}"
        return self.type


@dataclass(frozen=True)
class Specialization:
    """A compile request in version-free form: kernel name, arguments in parameter order, compile options.

    Parsed from request data, it also keeps that data, so closing (prewarm.planning.plan) reads its pointer and int arguments
    here and derives the requests Triton makes for other dtypes and int classes from it, without parsing again."""

    name: str  # as Triton records it: "module.qualname" (3.4+), the bare function name (3.2, key dirs)
    args: dict  # parameter name (tuple members "t[0]") -> Arg
    options: dict  # num_warps, num_stages, ... as the request / key dir holds them
    complete: bool = True  # False when rebuilt from a key dir: constexprs and args specialized to 1/None are gone
    context: dict = field(default_factory=dict)  # key dir only: "triton_version" and the env vars set at compile
    data: str = field(default="", compare=False, repr=False)  # the request data it was parsed from ("": a key dir)
    # upstream's layout (3.4+): int classes are read and rewritten by argument path. triton 3.2 keeps ints equal to 1
    # among the constexprs by name: its data is not rewritten (int_classes is empty)
    upstream: bool = field(default=False, compare=False)

    @property
    def function(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def pointers(self) -> dict[str, str]:
        """The pointer parameters (not tuple members) and their types ("*fp32", "*kbf16")."""
        return {n: a.type for n, a in self.args.items() if a.type.startswith("*") and "[" not in n}

    @property
    def int_classes(self) -> dict[str, tuple[str, str]]:
        """The classed int arguments in parameter order, name -> (width, class); one recorded as the constexpr 1 is
        an i32 ``INT_ONE`` (whether the kernel declared it constexpr is the caller's to tell from its params).
        {} for triton 3.2 data."""
        if not self.upstream:
            return {}
        out = {}
        for n, a in self.args.items():
            if "[" in n:
                continue
            if a.type == "constexpr" and a.value == 1:
                out[n] = ("i32", INT_ONE)
            elif a.type in INT_CLASSES:
                out[n] = (a.type, INT_DIVISIBLE if tuple(_DIVISIBLE) in a.attrs else INT_OTHER)
        return out

    def with_pointer_types(self, types: dict[str, str]) -> Specialization:
        """This request with the named pointer parameters of the given types, the rest as is."""
        obj = json.loads(self.data)
        return parse_specialization(json.dumps({**obj, "signature": {**obj["signature"], **types}}))

    def with_int_classes(self, classes: dict[str, tuple[str, str]]) -> Specialization:
        """This request (3.4+: names from :attr:`int_classes`) with the named int arguments in the given (width,
        class), as Triton records a call with such values. The ``key`` (the in-memory cache key) is kept: Triton's
        on-disk key does not read it."""
        obj = json.loads(self.data)
        index = {name: i for i, name in enumerate(obj["signature"])}
        sig = dict(obj["signature"])
        consts = {tuple(k): v for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
        attrs = {tuple(k): v for k, v in zip(obj["attrs_keys"], obj["attrs_vals"])}
        for name, (width, cls) in classes.items():
            path = (index[name],)
            if cls == INT_ONE:
                sig[name], consts[path] = "constexpr", 1
                attrs.pop(path, None)
            else:
                sig[name] = width
                consts.pop(path, None)
                attrs[path] = [_DIVISIBLE] if cls == INT_DIVISIBLE else []
        return parse_specialization(json.dumps({**obj, "signature": sig,
                           "constant_keys": [list(k) for k in sorted(consts)], "constant_vals": [consts[k] for k in sorted(consts)],
                           "attrs_keys": [list(k) for k in sorted(attrs)], "attrs_vals": [attrs[k] for k in sorted(attrs)]}))  # fmt: skip


_CONSTEXPR_DICT = "constexpr"


def parse_specialization(data: str, arg_names: Sequence[str] | None = None) -> Specialization:
    """A jit_cache_hook's ``specialization_data`` (either version) as a :class:`Specialization`.

    triton 3.2 lists constexprs apart from the signature and gives attrs by index into the full parameter list;
    ``arg_names`` (the kernel's ``arg_names``) orders them; without it constexprs are assumed to follow the other
    parameters, Triton's usual layout."""
    obj = json.loads(data)
    options = {k: v for k, v in obj.get("options", {}).items()}
    if "constants" in obj:  # 3.2
        sig, constants = obj["signature"], obj["constants"]
        names = list(arg_names) if arg_names else list(sig) + [n for n in constants if n not in sig]
        props = obj.get("attrs", {}).get("arg_properties", {})
        divisible = {names[i] for i in props.get("tt.divisibility", []) if i < len(names)}
        args = {}
        for n in names:
            if n in constants:  # constexprs, and ints equal to 1 (tt.equal_to): a value compiled in
                args[n] = Arg("constexpr", constants[n])
            elif n in sig:
                args[n] = Arg(sig[n], None, (("tt.divisibility", 16),) if n in divisible else ())
        return Specialization(obj["name"], args, options, data=data)
    params = list(obj["signature"].items())
    flat: dict[tuple, tuple[str, str]] = {}  # argument path -> (display name, type)

    def walk(path: tuple, name: str, ty) -> None:
        if isinstance(ty, (list, tuple)):
            for i, t in enumerate(ty):
                walk(path + (i,), f"{name}[{i}]", t)
        else:
            flat[path] = (name, ty)

    for i, (n, ty) in enumerate(params):
        walk((i,), n, ty)
    values = {tuple(k): v for k, v in zip(obj.get("constant_keys", []), obj.get("constant_vals", []))}
    attrs = {tuple(k): tuple(tuple(a) for a in v) for k, v in zip(obj.get("attrs_keys", []), obj.get("attrs_vals", []))}
    args = {}
    for path, (n, ty) in flat.items():
        if ty == "constexpr":
            v = values.get(path)
            args[n] = Arg("constexpr", v.get(_CONSTEXPR_DICT, v) if isinstance(v, dict) else v)
        else:
            args[n] = Arg(ty, None, attrs.get(path, ()))
    return Specialization(obj["name"], args, options, data=data, upstream=True)


# MLIR element types as Triton's signature strings name them
_MLIR_TYPES = {"f16": "fp16", "bf16": "bf16", "f32": "fp32", "f64": "fp64", "f8E4M3FN": "fp8e4nv", "f8E5M2": "fp8e5",
               "f8E4M3FNUZ": "fp8e4b8", "f8E5M2FNUZ": "fp8e5b16", "i1": "i1", "i8": "i8", "i16": "i16", "i32": "i32",
               "i64": "i64"}  # fmt: skip
_TT_FUNC = re.compile(r"tt\.func\s+public\s+@(\w+)\s*\(")
_TT_ARG = re.compile(r"%(\w+)\s*:\s*(!tt\.ptr<(\w+)(?:,\s*\d+)?>|\w+)\s*(\{[^}]*\})?\s*(?:loc\(\"(\w+)\")?")
# compile() stores ``{hash, target, **options, **env_vars}`` plus what the backend adds: not options of the request
_METADATA_NOT_OPTIONS = {"hash", "target", "name", "triton_version", "shared", "tmem_size", "global_scratch_size",
                         "global_scratch_align", "profile_scratch_size", "profile_scratch_align", "tensordesc_meta"}


def read_key_dir(path: str | os.PathLike) -> Specialization | None:
    """The request a key dir was compiled for, as far as Triton stored it (None: not a kernel entry).

    Known: the kernel's function name, its non-constexpr arguments with dtype and divisibility (from the TTIR's
    function signature), the compile options and the cache-invalidating env vars set at compile time (the metadata
    JSON). Not known: the kernel's module, constexpr values, and which arguments were specialized to 1 or None
    (Triton compiles those in and drops them from the signature)."""
    d = Path(path)
    for meta_path in sorted(d.glob("*.json")):
        if meta_path.name.startswith("__grp__") or meta_path.name.endswith(".autotune.json"):
            continue
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict) or "hash" not in meta or "name" not in meta:
            continue
        ir = next((p for p in (d / f"{meta_path.stem}.ttir", d / f"{meta_path.stem}.source") if p.is_file()), None)
        args = {}
        if ir is not None:
            text = ir.read_text(errors="replace")
            m = _TT_FUNC.search(text)
            if m:
                depth, end = 1, m.end()
                while end < len(text) and depth:
                    depth += {"(": 1, ")": -1}.get(text[end], 0)
                    end += 1
                for a in _TT_ARG.finditer(text[m.end():end]):
                    ssa, ty, pointee, braces, loc_name = a.groups()
                    ty = f"*{_MLIR_TYPES.get(pointee, pointee)}" if pointee else _MLIR_TYPES.get(ty, ty)
                    div = braces and re.search(r"tt\.divisibility\s*=\s*16\b", braces)
                    args[loc_name or ssa] = Arg(ty, None, (("tt.divisibility", 16),) if div else ())
        options = {k: v for k, v in meta.items() if k not in _METADATA_NOT_OPTIONS and not k.isupper()}
        context = {"triton_version": meta.get("triton_version"), "env": {k: v for k, v in meta.items() if k.isupper()}}
        return Specialization(meta["name"], args, options, complete=False, context=context)
    return None


# --- the on-disk cache key and what it is made of --------------------------------------------------------------
# compile() keys a request by sha256(f"{triton_key()}-{src.hash()}-{backend.hash()}-{options.hash()}-{env vars}")
# (:func:`cache_key_text`); src.hash() folds the kernel's ``cache_key`` (its source, starting line, the constexpr
# globals it and its callees read (3.4+), its callees' keys) into the request's signature, constexprs and attrs. A
# recording stores the key and these parts, so a host that cannot reproduce the key can say which part differs.


def ast_source(jit, data: dict):
    """The ASTSource ``JITFunction.preload`` builds from specialization ``data`` (either layout)."""
    if "constant_keys" not in data:  # 3.2 (triton-ascend): constants by name, an AttrsDescriptor
        return ascend_ast_source(jit, data, "3.2")
    import triton.language as tl
    from triton.compiler.compiler import ASTSource
    from triton.runtime.jit import convert_to_tuple_if_list

    def value(v):
        if isinstance(v, str) and tl.dtype.is_dtype(v):
            return tl.dtype(v)
        return tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v

    constexprs = {tuple(k): value(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: convert_to_tuple_if_list(v) for k, v in data["signature"].items()}
    return ASTSource(jit, signature, constexprs, attrs)


def on_disk(data: str) -> str:
    """The request ``data`` as far as the on-disk key reads it: without the in-memory ``key`` (which repeats the
    launch's own option kwargs), so two requests Triton keeps in one key dir compare equal."""
    obj = json.loads(data)
    obj.pop("key", None)
    return json.dumps(obj, sort_keys=True)


def key_dir_name(digest: str) -> str:
    """The dir name ``get_cache_manager`` keeps a hex key in (3.4+: base32; 3.2: urlsafe base64)."""
    from triton.runtime import cache

    encode = getattr(cache, "_base32", None) or cache._base64
    return encode(digest)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _folds_globals() -> bool:
    """Does this Triton fold the constexpr globals a kernel reads into its cache_key (3.4+; 3.2 only checks them
    at launch)?"""
    import triton

    return tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2]) >= (3, 4)


def _callees(jit) -> dict[str, dict]:
    """The @jit functions ``jit`` calls directly, as its ``cache_key`` folds them in: "module:qualname" -> their own
    cache_key, starting line and source digest (a callee's key covers its callees)."""
    import inspect

    from triton.runtime import jit as rt

    found: dict[str, dict] = {}

    class Callees(rt.DependenciesFinder):
        def _update_hash(self, func):
            super()._update_hash(func)
            fn = getattr(func, "fn", None)
            if fn is not None and hasattr(func, "cache_key"):
                found[f"{fn.__module__}:{fn.__qualname__}"] = {
                    "cache_key": func.cache_key, "line": func.starting_line_number, "source": _digest(func.src)}

    kwargs = {"name": getattr(jit, "_fn_name", jit.__name__), "globals": jit.__globals__, "src": jit.src}
    if "nonlocals" in inspect.signature(rt.DependenciesFinder.__init__).parameters:  # 3.4+
        kwargs["nonlocals"] = inspect.getclosurevars(jit.fn).nonlocals
    Callees(**kwargs).visit(jit.parse())
    return dict(sorted(found.items()))


_KERNEL_PARTS: dict[int, tuple[str, dict]] = {}  # id(jit) -> (its cache_key, kernel_key_parts): once per kernel


def kernel_key_parts(jit) -> dict:
    """What a kernel puts into every key of it: its ``cache_key`` and what Triton folds into that (source digest,
    starting line, the constexpr globals read, as "name" -> repr of the value, and the direct callees)."""
    from triton.language.core import constexpr

    cache_key = jit.cache_key  # computes used_global_vals too (Triton keeps both for the kernel's life)
    known = _KERNEL_PARTS.get(id(jit))
    if known is not None and known[0] == cache_key:
        return known[1]
    read = {}
    if _folds_globals():
        read = {name: repr(val.value) for (name, _), (val, _) in jit.used_global_vals.items()
                if isinstance(val, constexpr)}  # fmt: skip
    parts = {"cache_key": cache_key, "source": _digest(jit.src), "line": jit.starting_line_number,
             "globals": dict(sorted(read.items())), "calls": _callees(jit)}
    _KERNEL_PARTS[id(jit)] = (cache_key, parts)
    return parts


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def options_key_view(options) -> dict:
    """A backend's parsed options as their ``hash()`` reads them: name -> value, the libraries in ``extern_libs``
    by their content's digest (CUDAOptions.hash hashes the file, not its path)."""
    out = {}
    for name, value in sorted(options.__dict__.items()):
        if name == "extern_libs" and value:
            value = [[lib, hashlib.sha256(Path(path).read_bytes()).hexdigest() if os.path.isfile(path) else path]
                     for lib, path in sorted(value)]  # fmt: skip
        out[name] = _jsonable(value)
    return out


def cache_key_parts(jit, specialization_data: str, target=None) -> tuple[str, dict]:
    """(key dir, parts): the dir under TRITON_CACHE_DIR that ``compile()`` looks the request up in, in this process
    (this Triton, env vars, kernel source; ``target``: the active driver's by default), and what it composed the
    key of, each part as Triton itself computes it: ``triton`` (version, triton_key digest), ``kernel``
    (:func:`kernel_key_parts`), ``request`` (src.hash(): the kernel's key with the request's signature, constexprs
    and attrs), ``backend`` (backend.hash(); CUDA: ptxas's version text and the arch), ``options`` (options.hash()
    and :func:`options_key_view`) and ``env`` (the cache-invalidating env vars set)."""
    import triton
    from triton.compiler.compiler import make_backend
    from triton.runtime.driver import driver

    data = json.loads(specialization_data)
    jit = jit_function(jit)
    src = ast_source(jit, data)  # as preload rebuilds the request ...
    backend = make_backend(target or driver.active.get_current_target())
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))  # ... and compile() parses it
    env = cache_invalidating_env_vars()
    key = key_dir_name(_digest(cache_key_text(src, backend, options, env)))
    parts = {"triton": {"version": triton.__version__, "digest": triton_key()}, "kernel": kernel_key_parts(jit),
             "request": src.hash(), "backend": str(backend.hash()),
             "options": {"digest": options.hash(), "values": options_key_view(options)},
             "env": dict(sorted(env.items()))}  # fmt: skip
    return key, parts


# --- rewriting compile requests -----------------------------------------------------------------------------------
# Closing recorded traffic (plan.py) derives, from one recorded request, the ones Triton makes for other dtypes and
# int classes (Specialization.with_pointer_types / with_int_classes). Triton (3.4+) puts a specialized int argument in
# one of three classes: equal to 1 (compiled in as the constexpr 1), a multiple of 16 (tt.divisibility 16), neither;
# a 1 is an i32, so an i64 is in one of the last two.
INT_ONE, INT_DIVISIBLE, INT_OTHER = "=1", "%16=0", "other"
INT_CLASSES = {"i32": (INT_ONE, INT_DIVISIBLE, INT_OTHER), "i64": (INT_DIVISIBLE, INT_OTHER)}


def int_class(value: int) -> str:
    """The class Triton specializes an int argument's ``value`` on (INT_CLASSES)."""
    return INT_ONE if value == 1 else INT_DIVISIBLE if value % 16 == 0 else INT_OTHER
_DIVISIBLE = ["tt.divisibility", 16]


def pointer_type(dtype: str, const: bool = False) -> str:
    """Triton's signature type for a tensor of the torch dtype named ``dtype``: "*bf16", "*kfp32" (``const``)."""
    import torch
    from triton.runtime.jit import mangle_type  # its second parameter differs between versions: not passed

    return ("*k" if const else "*") + mangle_type(torch.empty(0, dtype=getattr(torch, dtype), device="meta"))[1:]


# --- triton-ascend versions ---------------------------------------------------------------------------------------
# Two layouts: "3.2" (triton-ascend 3.2.x, on the registry today: a triton 3.2 core) and "3.5" (its main branch,
# 3.5/3.6: a triton 3.5 core, which fla-core's NPU extra already pins). What differs, read from both sources:
# the specialization data (3.2: "constants" by name and "attrs"/"arg_properties" by index; 3.5: upstream's
# constant_keys/attrs_keys by argument path), the cache key's home and key-dir encoding (3.2: compiler.py,
# urlsafe base64; 3.5: runtime/cache.py get_cache_key, base32), the compiler lookup (3.5 tries the
# bishengir-compile bundled in the wheel first) and what NPUOptions holds (3.5: bisheng_options names libdevice by
# its absolute install path, so the key depends on where triton is installed; compile_on_910_95 read from the
# node's PCI ids / npu-smi, where 3.2.0 hard-codes False).

ASCEND_LAYOUTS = ("3.2", "3.5")
ASCEND_BUNDLED_COMPILER = ("bishengir", "bin", "bishengir-compile")  # under triton/backends/ascend on 3.5+


def ascend_layout(version: str | None = None) -> str:
    """"3.2" or "3.5" for a triton-ascend ``version`` (default: the installed one)."""
    version = version or triton_distribution()[1]
    major, minor = (int(x) for x in re.findall(r"\d+", version)[:2])
    return "3.5" if (major, minor) >= (3, 5) else "3.2"


def ascend_backend_dir() -> Path | None:
    """triton/backends/ascend of the installed triton-ascend (None: not installed), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "backends" / "ascend"
    return path if path.is_dir() else None


def ascend_key_dir(digest: str, layout: str | None = None) -> str:
    """The dir ``get_cache_manager`` keeps a hex key in: urlsafe base64 on 3.2 (runtime/cache.py _base64), base32
    on 3.5+ (_base32, as upstream 3.4+)."""
    import base64

    raw = bytes.fromhex(digest)
    if (layout or ascend_layout()) == "3.5":
        return base64.b32encode(raw).decode().rstrip("=")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


# Every dir Triton keeps in its cache is named by get_cache_manager(hex digest): the digest's bytes, urlsafe base64 on
# 3.2 (upstream and triton-ascend 3.2: runtime/cache.py _base64), base32 from 3.3 on (_base32; triton-ascend 3.5 as
# well), "=" padding stripped. Its callers hash with sha256 (kernels, cuda_utils/hip_utils and launchers, autotune
# results, triton-ascend's launchers and precompiled header), except triton-ascend's npu_utils (md5 of its source).
# The last character holds the digest's last bits then zero bits, so only some characters can end a key.
_KEY_DIR_FORMS = {  # (encoding, digest bytes): the exact form
    ("base64", 32): r"[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]",
    ("base64", 16): r"[A-Za-z0-9_-]{21}[AQgw]",
    ("base32", 32): r"[A-Z2-7]{51}[AQ]",
    ("base32", 16): r"[A-Z2-7]{25}[AEIMQUY4]",
}
_KEY_DIR_WORDS = {("base64", 32): "urlsafe base64 of a sha256 (43 characters)",
                  ("base64", 16): "urlsafe base64 of an md5 (22 characters: npu_utils)",
                  ("base32", 32): "base32 of a sha256 (52 characters A-Z 2-7)",
                  ("base32", 16): "base32 of an md5 (26 characters: npu_utils)"}


@functools.lru_cache()
def key_dir_form(distribution: str | None, version: str | None) -> tuple[re.Pattern, str]:
    """(a pattern that fullmatches exactly the key dir names that Triton ``distribution`` ``version`` writes, its
    description). Where either is not known: every form Triton 3.2+ writes."""
    encodings = {"base64", "base32"}
    numbers = [int(x) for x in re.findall(r"\d+", version or "")[:2]]
    if len(numbers) == 2:  # 3.3 is not a release prewarm supports: both forms
        encodings = {"base64"} if tuple(numbers) < (3, 3) else {"base32"} if tuple(numbers) > (3, 3) else encodings
    digests = {32} if distribution not in ("triton-ascend", None, "unknown") else {32, 16}
    forms = sorted((e, d) for e in encodings for d in digests)
    return (re.compile("|".join(_KEY_DIR_FORMS[f] for f in forms)),
            " or ".join(_KEY_DIR_WORDS[f] for f in forms) + ", without padding")


def ascend_ast_source(jit, data: dict, layout: str | None = None):
    """The ASTSource ``JITFunction.preload`` builds from specialization ``data`` (3.2: constants by name and an
    AscendAttrsDescriptor; 3.5+: constexprs and attrs keyed by argument path, as upstream)."""
    import triton.language as tl
    from triton.compiler.compiler import ASTSource

    def value(v):
        return tl.dtype(v) if isinstance(v, str) and tl.dtype.is_dtype(v) else v

    if (layout or ascend_layout()) == "3.5":
        constexprs = {tuple(k): value(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
        attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
        return ASTSource(jit, dict(data["signature"]), constexprs, attrs)
    from triton.backends.ascend.compiler import AscendAttrsDescriptor

    constants = {k: value(v) for k, v in data["constants"].items()}
    return ASTSource(jit, dict(data["signature"]), constants, AscendAttrsDescriptor.from_dict(data["attrs"]))


def cache_key_text(src, backend, options, env_vars: dict) -> str:
    """compile()'s key text, which it hashes into the key (3.2: inline in compiler.py; 3.4+: runtime/cache.py
    get_cache_key, same text)."""
    try:
        from triton.runtime.cache import get_cache_key  # 3.5+

        return get_cache_key(src, backend, options, env_vars=env_vars)
    except ImportError:
        from triton.compiler.compiler import triton_key

        return f"{triton_key()}-{src.hash()}-{backend.hash()}-{options.hash()}-{str(sorted(env_vars.items()))}"


ASCEND_FRONT_END = ("ast", "ttir", "ttadapter")  # compile()'s stages that run without CANN, in its order


@dataclass
class FrontEnd:
    """compile()'s front end set up for one request: where it keys, with what options, and its stages to run."""

    key_dir: str  # the key dir under TRITON_CACHE_DIR compile() would use for the request
    options: Any  # the backend's parsed options (NPUOptions)
    steps: list  # [(stage name, step)], ASCEND_FRONT_END's present stages in order; step(previous module) -> module


@contextlib.contextmanager
def ascend_front_end(jit, specialization_data: str, target):
    """triton-ascend's ``compile()`` pipeline for exactly the request ``preload(specialization_data)`` compiles, on
    ``target``, as far as it runs without CANN: keyed and staged as compile() does it, the stages left to the caller
    to run in order. The MLIR context lives for the block. The 3.5 layout follows upstream 3.5's compile() (target
    and language passed, codegen per options, no thread pool to stop), read from its source: no 3.5 wheel to run."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    layout = ascend_layout()
    data = json.loads(specialization_data)
    src = ascend_ast_source(jit, data, layout)  # as JITFunction.preload rebuilds the request ...
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    # ... and compile() keys and stages it.
    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **src.parse_options()))
    env_vars = cache_invalidating_env_vars()
    digest = hashlib.sha256(cache_key_text(src, backend, opts, env_vars).encode()).hexdigest()
    metadata = {"hash": digest, "target": target, **opts.__dict__, **env_vars}
    stages: dict = {}
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    if layout == "3.5":
        import triton

        metadata["triton_version"] = triton.__version__
        backend.add_stages(stages, opts, src.language)
        make_ir_args = (target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    else:
        backend.add_stages(stages, opts)
        make_ir_args = (opts, backend.get_codegen_implementation(), backend.get_module_map(), context)
    # (simt-only kernels have no ttadapter stage: ttir goes straight to bishengir-compile)
    steps = [(ASCEND_FRONT_END[0], lambda _: src.make_ir(*make_ir_args))]
    steps += [(name, lambda m, f=stages[name]: f(m, metadata)) for name in ASCEND_FRONT_END[1:] if name in stages]
    try:
        yield FrontEnd(ascend_key_dir(digest, layout), opts, steps)
    finally:
        if layout == "3.2":
            context.disable_multithreading()  # as compile(): a later fork must not inherit a live thread pool


def ascend_compiler_path(layout: str | None = None, backend_dir: Path | None = None) -> str | None:
    """bishengir-compile as triton-ascend's ``utils._get_npucompiler_path`` resolves it: on 3.5+ the one bundled in
    the wheel first; then PATH; then $TRITON_NPU_COMPILER_PATH/npuc. None where that file does not exist."""
    import shutil

    layout = layout or (ascend_layout() if triton_distribution()[0] == "triton-ascend" else "3.2")
    backend_dir = backend_dir or ascend_backend_dir()
    if layout == "3.5" and backend_dir is not None and backend_dir.joinpath(*ASCEND_BUNDLED_COMPILER).is_file():
        return str(backend_dir.joinpath(*ASCEND_BUNDLED_COMPILER))
    found = shutil.which("bishengir-compile")
    if found is None:
        found = os.path.join(os.environ.get("TRITON_NPU_COMPILER_PATH", ""), "npuc")
    return found if os.path.isfile(found) else None


@functools.lru_cache()
def _ascend_sources(backend_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(backend_dir.rglob("*.py")))


def ascend_reads_env(name: str, backend_dir: Path | None = None) -> bool:
    """Does the installed triton-ascend backend read env var ``name`` at all (TRITON_ENABLE_UBTUNER: not 3.2.0)?"""
    backend_dir = backend_dir or ascend_backend_dir()
    return backend_dir is not None and f'"{name}"' in _ascend_sources(backend_dir)


def ascend_compile_on_910_95() -> bool | None:
    """The 910_95 flag NPUOptions carries (in the key, and switching the pipeline): triton-ascend 3.5+ reads it from
    the node (PCI device 0xd806 or npu-smi); None where the installed release has no detection (3.2.0: False)."""
    import importlib.util

    if triton_distribution()[0] != "triton-ascend" or importlib.util.find_spec("triton.tools.get_ascend_devices") is None:
        return None
    from triton.tools.get_ascend_devices import is_compile_on_910_95

    return bool(is_compile_on_910_95)


def ascend_install_path_in_key(option_defaults: dict | None = None) -> str | None:
    """The install dir NPUOptions' defaults embed (3.5+: bisheng_options = "... <backend>/lib/libdevice.10.bc"), so
    two installs at different paths have different keys; None where the options hold no path (3.2.0)."""
    if option_defaults is None:
        if triton_distribution()[0] != "triton-ascend":
            return None
        from triton.backends.ascend.compiler import NPUOptions

        option_defaults = NPUOptions().__dict__
    paths = [w for w in str(option_defaults.get("bisheng_options") or "").split() if os.path.isabs(w)]
    return paths[0] if paths else None
