"""Triton's Autotuner, as each version runs it: the call it receives, its configs, pinning one, keeping results on
disk, and the tuning key a call makes without benchmarking."""
from __future__ import annotations

from dataclasses import dataclass, field

from .releases import release


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
    if not isinstance(kernel, Autotuner) or not can_keep_results(kernel):
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
    return release().knobs


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
