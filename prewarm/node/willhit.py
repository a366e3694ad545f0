"""Will-hit: would this environment's Triton find every planned kernel in a cache dir? Computed without compiling.

Each planned compile is looked up through Triton's own key computation, stopped at the lookup (prewarm.building.probe).
The C modules the runtime builds at first launch are looked up the same way by the target's backend
(prewarm.building.backends): on CUDA each hit kernel is loaded from the cache and the driver's own launcher class asked for
its ``__triton_launcher`` (and ``cuda_utils`` once); an absent one is built with the node's C compiler at first
launch (about a second, no kernel compile). A planned kernel this environment's Triton cannot key at all
(``plan.WillFail``) is no hit and no miss: the node's first call of it raises before any lookup; the report lists
it (``will_fail``).

Each planned module past Triton (an sglang JIT module, a FlashInfer module: prewarm.jit) is looked up by its library's
own lookup in the dir that library reads (``jit``): sglang recomputes its build key and checks the leaf's recorded
dependencies, as ``load_jit`` does before deciding to compile.

A kernel pinned in the manifest's autotune table, and every autotuned kernel where Triton keeps no results
(triton-ascend 3.2), is one row: pinned (its config: the guard runs it alone) or absent (the node benchmarks its
configs in every process). Other autotuned calls are probed the same way one level up
(prewarm.building.autotune.planned_tunings): a copy of the Autotuner
runs the planned call, computes its tuning key and asks the cache for ``<kernel>.autotune.json``; the probe stops
it there. Where that file is absent the node benchmarks every config once per process (an offline build has it
only from an autotune table; a device build does). A file this process's Autotuner would not read (it keeps no
results: no ``cache_results``, TRITON_CACHE_AUTOTUNING unset) is shipped for nothing: the node benchmarks anyway.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..building import backends, keys
from .. import jit
from ..building.autotune import autotuned_kernels, kept_timings, planned_tunings
from ..building.backends import npu
from ..jit import JitRequest, Lookup
from ..planning.manifest import load
from ..planning.plan import Request, WillFail, plan_for
from ..building.probe import ModuleResult, RequestResult, probe_all


@dataclass
class AutotuneResult:
    label: str  # the first planned call with this tuning key
    kernel: str
    key: str  # the cache key dir the Autotuner looks in
    present: bool
    configs: int  # how many configs the node benchmarks when the result is absent
    detail: str
    tuning_key: str = ""  # str() of Triton's tuning key
    reads: bool = True  # this process's Autotuner reads kept results (the server's, where it shares this env)
    pinned: str = ""  # the kernel's pinned config (one row for every tuning key): the guard runs it alone

    @property
    def unread(self) -> bool:
        """Shipped, but the Autotuner keeps no results in this environment: the node benchmarks anyway."""
        return self.present and not self.reads

    def to_json(self) -> dict:
        return {"label": self.label, "kernel": self.kernel, "key": self.key, "present": self.present,
                "configs": self.configs, "detail": self.detail, "tuning_key": self.tuning_key, "reads": self.reads,
                "unread": self.unread, "pinned": self.pinned}


@dataclass
class WillHitReport:
    manifest: str
    cache_dir: str
    target: str
    results: list[RequestResult] = field(default_factory=list)
    autotune: list[AutotuneResult] = field(default_factory=list)  # calls whose Autotuner keeps results on disk
    modules: list[ModuleResult] = field(default_factory=list)  # CUDA launchers and cuda_utils
    key_drift: list[keys.KeyDrift] = field(default_factory=list)  # recorded requests this process keys otherwise
    will_fail: list[WillFail] = field(default_factory=list)  # planned kernels this Triton cannot key (never looked up)
    jit: list[Lookup] = field(default_factory=list)  # each planned module past Triton, by its library's own lookup
    jit_dirs: dict[str, str] = field(default_factory=dict)  # layout -> the dir it was looked up in

    @property
    def hits(self) -> int:
        return sum(r.hit for r in self.results)

    @property
    def misses(self) -> int:
        return len(self.results) - self.hits

    @property
    def jit_misses(self) -> list[Lookup]:
        return [j for j in self.jit if not j.hit]

    @property
    def ok(self) -> bool:
        return self.misses == 0 and not self.jit_misses

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
            "autotune_unread": sum(a.unread for a in self.autotune),
            "modules": [m.to_json() for m in self.modules],
            "modules_absent": sum(not m.present for m in self.modules),
            "key_drift": [d.to_json() for d in self.key_drift],
            "will_fail": [w.to_json() for w in self.will_fail],
            "jit": [j.to_json() for j in self.jit],
            "jit_misses": len(self.jit_misses),
            "jit_dirs": self.jit_dirs,
        }


UNREAD = ("this process's Autotuner keeps no results (no cache_results, TRITON_CACHE_AUTOTUNING unset when its "
          "module was imported): the node benchmarks anyway; set TRITON_CACHE_AUTOTUNING=1 for verify and the server")


def probe_autotune_all(requests: list[Request], cache_dir: str, pins: dict | None = None) -> list[AutotuneResult]:
    """One result per tuning key the plan makes: is its kept result in ``cache_dir``, and would it be read here?
    One per kernel instead for a pinned kernel (``pins``: it runs its pin alone under the guard, whatever the key)
    and for every autotuned kernel where Triton keeps no results (triton-ascend 3.2): pinned, or absent."""
    out, whole = [], set()
    for k in autotuned_kernels(requests, pins or {}):
        if k.pin is None and k.keeps:
            continue  # per tuning key, below
        whole.add(k.kernel)
        detail = (f"pinned: {k.pin.describe()} ({k.pin.source}): the guard gives its Autotuner this config alone"
                  if k.pin else f"not pinned: the node benchmarks its {len(k.configs)} configs at the first call of "
                                f"each tuning key, in every process (this Triton keeps no autotune results)")
        out.append(AutotuneResult(k.label, k.kernel, "-", k.pin is not None, len(k.configs), detail,
                                  "every tuning key", pinned=k.pin.describe() if k.pin else ""))
    for t in planned_tunings(requests):
        if t.kernel in whole:
            continue
        n = len(t.configs)
        if t.problem:
            out.append(AutotuneResult(t.label, t.kernel, t.key, False, n, t.problem, reads=t.keeps))
            continue
        try:
            timings = kept_timings(cache_dir, t)
        except (OSError, ValueError, KeyError, TypeError) as e:
            out.append(AutotuneResult(t.label, t.kernel, t.key, False, n, f"{t.filename} is unreadable "
                                      f"({type(e).__name__}): the node benchmarks {n} configs", t.tuning_key, t.keeps))
            continue
        if not timings:
            unread = "" if t.keeps else (" (and keeps none in this environment: TRITON_CACHE_AUTOTUNING unset, so it "
                                         "would benchmark with one too)")
            out.append(AutotuneResult(t.label, t.kernel, t.key, False, n, f"no {t.filename}: the node benchmarks {n} "
                                      f"configs once per process{unread}", t.tuning_key, t.keeps))
            continue
        best = _config_text(min(timings, key=timings.get))
        detail = f"kept: {best}" if t.keeps else f"kept ({best}), but {UNREAD}"
        out.append(AutotuneResult(t.label, t.kernel, t.key, True, n, detail, t.tuning_key, t.keeps))
    return out


def _config_text(config: str) -> str:
    """"BS: 64, num_warps: 4, num_ctas: 1, num_stages: 2, maxnreg: None" (str(config)) -> "BS=64 warps=4 stages=2"."""
    parts = dict(p.split(": ", 1) for p in config.split(", ") if ": " in p)
    kw = [f"{k}={v}" for k, v in parts.items() if k not in ("num_warps", "num_ctas", "num_stages", "maxnreg")]
    return " ".join(kw + [f"warps={parts.get('num_warps')}", f"stages={parts.get('num_stages')}"])


def check(manifest_path: str, cache_dir: str, mode: str = "auto",
          jit_dirs: dict[str, str] | None = None) -> WillHitReport:
    """For every compile the manifest plans, would this environment's runtime find it in ``cache_dir``? And every
    planned module past Triton in its library's dir (``jit_dirs``: layout -> dir; by default the dir each library
    reads in this environment)?"""
    with npu.prints_to_stderr():
        return _check(manifest_path, cache_dir, mode, jit_dirs or {})


def check_jit(requests: list[JitRequest], dirs: dict[str, str], arch: str | None) -> tuple[list[Lookup], dict[str, str]]:
    """Each module past Triton looked up by its library's own code (no build) in ``dirs[layout]``, else in the dir
    the library reads in this environment, for ``arch`` (None: this process's GPU, as the server's lookup); (the
    lookups, layout -> the dir looked in)."""
    lookups, used = [], {}
    for name, group in jit.by_library(requests).items():
        lib = jit.library(name)
        root = Path(dirs.get(lib.layout) or lib.node_dir())
        used[lib.layout] = str(root)
        lookups += lib.lookup(group, root, arch)
    return lookups, used


def _check(manifest_path: str, cache_dir: str, mode: str, jit_dirs: dict[str, str]) -> WillHitReport:
    planned = plan_for(*backends.select(load(manifest_path), mode))
    report = WillHitReport(planned.manifest.name, os.path.abspath(cache_dir), planned.target.describe())
    report.will_fail = planned.will_fail
    report.results = probe_all(planned.compiles, cache_dir)
    # a recorded request keyed otherwise here than in its recorded process: its row says which part differs (this
    # verdict is about a key that process would not look up)
    report.key_drift = keys.check(planned.requests, planned.compiles, [r.key for r in report.results])
    for d in report.key_drift:
        report.results[d.compile_index].detail += f"; {d.summary()}"
    report.autotune = probe_autotune_all(planned.requests, os.path.abspath(cache_dir), planned.pins)
    report.modules = backends.probe_modules(planned.target, planned.compiles, report.results, cache_dir)
    # on a node (device mode) the GPU decides, as in the server; elsewhere the manifest's target
    arch = None if planned.target.mode == "device" else planned.target.arch
    report.jit, report.jit_dirs = check_jit(planned.jit, jit_dirs, arch)
    return report
