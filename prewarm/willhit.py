"""Will-hit: would this environment's Triton find every planned kernel in a cache dir? Computed without compiling.

Each planned compile is looked up through Triton's own key computation, stopped at the lookup (prewarm.probe).
The C modules the runtime builds at first launch are looked up the same way by the target's backend
(prewarm.backends): on CUDA each hit kernel is loaded from the cache and the driver's own launcher class asked for
its ``__triton_launcher`` (and ``cuda_utils`` once); an absent one is built with the node's C compiler at first
launch (about a second, no kernel compile).

Autotuned calls are probed the same way one level up: a copy of the Autotuner runs the planned call, computes its
tuning key and asks the cache for ``<kernel>.autotune.json``; the probe stops it there. Where that file is absent
the node benchmarks every config once per process (an offline build never has it; a device build does).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import backends, tritoncompat
from .backends import npu
from .manifest import load
from .plan import Request, decode, plan_for, resolve
from .probe import ModuleResult, Probe, ProbeCacheManager, RequestResult, probe_all


@dataclass
class AutotuneResult:
    label: str  # the first planned call with this tuning key
    kernel: str
    key: str  # the cache key dir the Autotuner looks in
    present: bool
    configs: int  # how many configs the node benchmarks when the result is absent
    detail: str

    def to_json(self) -> dict:
        return {"label": self.label, "kernel": self.kernel, "key": self.key, "present": self.present,
                "configs": self.configs, "detail": self.detail}


@dataclass
class WillHitReport:
    manifest: str
    cache_dir: str
    target: str
    results: list[RequestResult] = field(default_factory=list)
    autotune: list[AutotuneResult] = field(default_factory=list)  # calls whose Autotuner keeps results on disk
    modules: list[ModuleResult] = field(default_factory=list)  # CUDA launchers and cuda_utils

    @property
    def hits(self) -> int:
        return sum(r.hit for r in self.results)

    @property
    def misses(self) -> int:
        return len(self.results) - self.hits

    @property
    def ok(self) -> bool:
        return self.misses == 0

    def to_json(self) -> dict:
        return {
            "manifest": self.manifest,
            "cache_dir": self.cache_dir,
            "target": self.target,
            "total": len(self.results),
            "hits": self.hits,
            "misses": self.misses,
            "ok": self.ok,
            "results": [r.to_json() for r in self.results],
            "autotune": [a.to_json() for a in self.autotune],
            "autotune_absent": sum(not a.present for a in self.autotune),
            "modules": [m.to_json() for m in self.modules],
            "modules_absent": sum(not m.present for m in self.modules),
        }


def probe_autotune(r: Request, cache_dir: str) -> AutotuneResult | None:
    """Would the node's Autotuner find a kept result for this call? None when the call keeps nothing on disk."""
    if r.specialization is not None:  # a recorded compile: one config, no tuning key
        return None
    kernel = resolve(r.kernel)
    args = tuple(decode(a) for a in r.args)
    named = {k: decode(v) for k, v in r.kwargs.items()}
    if not args:  # a manifest's function entry names every argument: probe the usual positional call (the tuning
        # key lists tensor dtypes in argument order), up to the first parameter it leaves out (an autotuned one)
        for p in tritoncompat.jit_function(kernel).arg_names:
            if p not in named:
                break
            args += (named.pop(p),)
    call = tritoncompat.autotuned_call(kernel, args, named)
    if call is None:
        return None
    tuner, args, kwargs = call
    try:
        tritoncompat.first_tuning(tuner, args, kwargs)
    except Probe as p:
        if not p.filename.endswith(".autotune.json"):
            return None  # one config (or a cached choice): straight to the kernel lookup, nothing is tuned
        path = os.path.join(os.path.realpath(cache_dir), p.key, p.filename)
        n = len(tuner.configs)
        try:
            timings = json.loads(Path(path).read_text())["configs_timings"]
            best = min(timings, key=lambda ct: ct[1])[0]
            kw = " ".join(f"{k}={v}" for k, v in best.get("kwargs", {}).items())
            return AutotuneResult(r.label, r.kernel, p.key, True, n,
                                  f"kept: {kw} warps={best.get('num_warps')} stages={best.get('num_stages')}")
        except FileNotFoundError:
            return AutotuneResult(r.label, r.kernel, p.key, False, n,
                                  f"no {p.filename}: the node benchmarks {n} configs once per process")
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            return AutotuneResult(r.label, r.kernel, p.key, False, n,
                                  f"{p.filename} is unreadable ({type(e).__name__}): the node benchmarks {n} configs")
    except tritoncompat.NoBenchmark:
        return None  # configs with pre_hooks or no tuning key: Triton never keeps these
    except Exception as e:  # e.g. a prune or perf-model hook failing on meta tensors: said, not fatal
        return AutotuneResult(r.label, r.kernel, "-", False, len(tuner.configs),
                              f"cannot compute the tuning key: {type(e).__name__}: {e}")
    return None


def probe_autotune_all(requests: list[Request], cache_dir: str) -> list[AutotuneResult]:
    """One result per tuning key (many calls share one: the key leaves out what the Autotuner ignores)."""
    found: dict[tuple[str, str], AutotuneResult] = {}
    with tritoncompat.cache_scope(os.path.abspath(cache_dir), ProbeCacheManager):
        for r in requests:
            a = probe_autotune(r, cache_dir)
            if a is not None:
                found.setdefault((a.kernel, a.key), a)
    return list(found.values())


def check(manifest_path: str, cache_dir: str, mode: str = "auto") -> WillHitReport:
    """For every compile the manifest plans, would this environment's runtime find it in ``cache_dir``?"""
    with npu.prints_to_stderr():
        return _check(manifest_path, cache_dir, mode)


def _check(manifest_path: str, cache_dir: str, mode: str) -> WillHitReport:
    planned = plan_for(*backends.select(load(manifest_path), mode))
    report = WillHitReport(planned.manifest.name, os.path.abspath(cache_dir), planned.target.describe())
    report.results = probe_all(planned.compiles, cache_dir)
    report.autotune = probe_autotune_all(planned.requests, cache_dir)
    report.modules = backends.probe_modules(planned.target, planned.compiles, report.results, cache_dir)
    return report
