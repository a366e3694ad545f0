"""Will-hit: would this environment's Triton find every planned kernel in a cache dir? Computed without compiling.

Each planned compile is replayed through the real JIT path (``JITFunction.preload``) with a cache manager whose
``get_group`` raises: Triton's ``compile()`` computes the key exactly as at runtime (this process's triton,
Python ABI, env vars, the kernel's source and line number) and asks for ``__grp__<name>.json`` under the key
dir; the probe stops it right there and the entry is inspected (group file present, every child file present
and inside the cache dir, as the runtime's ``get_group`` needs it).

On CUDA the C modules Triton builds at first launch are looked up the same way: each hit kernel is loaded from the
cache and the driver's own launcher class asked for its ``__triton_launcher`` (and ``cuda_utils`` once); an absent
one is built with the node's C compiler at first launch (about a second, no kernel compile).

Autotuned calls are probed the same way one level up: a copy of the Autotuner runs the planned call, computes its
tuning key and asks the cache for ``<kernel>.autotune.json``; the probe stops it there. Where that file is absent
the node benchmarks every config once per process (an offline build never has it; a device build does).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from triton.runtime.cache import FileCacheManager

from . import tritoncompat
from .explain import Explanation, explain_miss
from .manifest import Manifest, load
from .plan import Compile, Request, decode, expand_all, plan, resolve
from .targets import Target, get_target


class Probe(Exception):
    """Raised from the cache lookup inside compile(): carries the key dir and file Triton looked for."""

    def __init__(self, key: str, cache_dir: str, filename: str):
        super().__init__(f"{key}/{filename}")
        self.key, self.cache_dir, self.filename = key, cache_dir, filename


class ProbeCacheManager(FileCacheManager):
    """A FileCacheManager that never creates anything and stops compile() at its first lookup."""

    def __init__(self, key, override=False, dump=False):
        if override or dump:
            super().__init__(key, override, dump)
            return
        self.key = key
        self.cache_dir = os.path.join(tritoncompat.cache_dir(), key)
        self.lock_path = os.path.join(self.cache_dir, "lock")

    def get_group(self, filename):
        raise Probe(self.key, self.cache_dir, filename)

    def get_file(self, filename):  # the Autotuner's lookup of a kept result
        raise Probe(self.key, self.cache_dir, filename)


@dataclass
class RequestResult:
    label: str
    kernel: str  # "module:name"
    key: str | None  # the cache key dir Triton looks in (None when the key could not be computed)
    hit: bool
    detail: str
    explanation: Explanation | None = None  # a MISS: the cache's nearest entry of the kernel and what differs

    def to_json(self) -> dict:
        return {"label": self.label, "kernel": self.kernel, "key": self.key, "hit": self.hit, "detail": self.detail,
                "explanation": self.explanation.to_json() if self.explanation is not None else None}


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
class ModuleResult:
    """A C module the CUDA runtime builds at first launch: a kernel signature's launcher, or cuda_utils."""

    name: str  # "__triton_launcher" | "cuda_utils"
    key: str
    present: bool
    kernels: int  # planned compiles that launch through it (0 for cuda_utils)

    def to_json(self) -> dict:
        return {"name": self.name, "key": self.key, "present": self.present, "kernels": self.kernels}


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


def entry_state(cache_dir: str, key: str, filename: str) -> tuple[bool, str]:
    """(hit, why) for one key dir as Triton's FileCacheManager.get_group + compile() would see it."""
    root = os.path.realpath(cache_dir)
    grp = os.path.join(root, key, f"__grp__{filename}")
    if not os.path.isfile(grp):
        return False, f"not in the cache (no {key}/__grp__{filename}): the node would compile it"
    try:
        children = json.loads(Path(grp).read_text())["child_paths"]
    except (ValueError, KeyError, TypeError):
        return False, f"{key}/__grp__{filename} is unreadable: the node would compile it"
    if filename not in children:
        return False, f"{key}/__grp__{filename} lists no {filename}: the node would compile it"
    outside = [p for p in children.values() if not os.path.realpath(p).startswith(root + os.sep)]
    if outside:
        return False, f"group file points outside the cache dir ({outside[0]}): not relocated for this location"
    missing = sorted(c for c, p in children.items() if not os.path.exists(p))
    if missing:
        return False, f"entry {key} is incomplete (missing {', '.join(missing)}): the node would compile it"
    return True, "present"


def lookup(kernel, specialization: str) -> Probe | None:
    """Where Triton looks this request up (key dir and file), with ProbeCacheManager in scope; None: it did not
    look (a compile or key error propagates: the runtime would fail the same way)."""
    try:
        tritoncompat.preload(kernel, specialization)
    except Probe as p:
        return p
    return None


def probe(c: Compile, cache_dir: str) -> RequestResult:
    """Hit or miss for one compile, under the active target and ``cache_dir`` (already in scope)."""
    try:
        p = lookup(resolve(c.kernel), c.specialization)
    except Exception as e:  # the key itself could not be computed: the runtime would fail the same way
        return RequestResult(c.label, c.kernel, None, False, f"cannot compute the key: {type(e).__name__}: {e}")
    if p is None:
        return RequestResult(c.label, c.kernel, None, False, "Triton did not look this kernel up in the cache")
    hit, detail = entry_state(cache_dir, p.key, p.filename)
    return RequestResult(c.label, c.kernel, p.key, hit, detail)


def probe_all(compiles: list[Compile], cache_dir: str) -> list[RequestResult]:
    """Hit or miss for each compile; each miss explained against the cache's nearest entry of its kernel."""
    with tritoncompat.cache_scope(os.path.abspath(cache_dir), ProbeCacheManager):
        results = [probe(c, cache_dir) for c in compiles]
    for c, r in zip(compiles, results):
        if not r.hit and r.key is not None:
            r.explanation = explain_miss(c, cache_dir, r.key)
            r.detail = f"{r.detail}; {r.explanation.summary()}"
    return results


class _NoBenchmark(Exception):
    """Raised by the probe copy's ``_bench``: the Autotuner tried to benchmark without asking the disk first."""


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
    probe_copy = copy.copy(tuner)
    probe_copy.cache = {}

    def no_benchmark(*a, **k):
        raise _NoBenchmark

    probe_copy._bench = no_benchmark
    try:
        probe_copy.run(*args, grid=(1,), warmup=True, **kwargs)
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
    except _NoBenchmark:
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


class _ReadOnlyCacheManager(FileCacheManager):
    """Loads what is in the cache; refuses to write (verify changes nothing)."""

    def put(self, data, filename, binary=True):
        raise RuntimeError(f"verify would have written {self.key}/{filename}")


def probe_cuda_modules(compiles: list[Compile], results: list[RequestResult], cache_dir: str) -> list[ModuleResult]:
    """For every kernel that hits, is its launcher in the cache, and is cuda_utils? One result per module key."""
    root = os.path.realpath(cache_dir)
    with tritoncompat.cache_scope(os.path.abspath(cache_dir), _ReadOnlyCacheManager):
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
        lookup("cuda_utils", lambda: tritoncompat.cuda_utils(build=False))
        for kernel in kernels:
            lookup("__triton_launcher", lambda: tritoncompat.cuda_launcher(kernel, build=False))
    return list(found.values())


class _NpuModuleLookup(ProbeCacheManager):
    """triton-ascend's runtime-module lookups, recorded in ``seen`` and stopped before anything is built: a present
    header or npu_utils is answered with its path (npu_utils is then loaded, as the node does), an absent header
    with the path it would have, an absent npu_utils with the one this process's driver loaded (the launcher source
    needs its AI-core count); a launcher lookup raises Probe."""

    seen: list[tuple[str, str, bool]] = []  # (key, file, present) of each lookup since the last clear

    def get_file(self, filename):
        path = os.path.join(self.cache_dir, filename)
        present = os.path.isfile(path)
        _NpuModuleLookup.seen.append((self.key, filename, present))
        if filename in tritoncompat.NPU_HEADER_FILES or filename == tritoncompat.NPU_UTILS_FILE and present:
            return path
        loaded = tritoncompat.npu_utils_loaded() if filename == tritoncompat.NPU_UTILS_FILE else None
        if loaded is not None:
            return loaded
        raise Probe(self.key, self.cache_dir, filename)


def probe_npu_modules(compiles: list[Compile], results: list[RequestResult], cache_dir: str) -> list[ModuleResult]:
    """What triton-ascend builds with g++ at a node's first launch, for every kernel that hits: its launcher, the
    precompiled header (a missing one is built even when every launcher is there) and npu_utils. Keys computed by
    triton-ascend's own constructors; one result per key."""
    with tritoncompat.cache_scope(os.path.abspath(cache_dir), _ReadOnlyCacheManager):
        kernels = [tritoncompat.load_compiled(resolve(c.kernel), c.specialization)
                   for c, r in zip(compiles, results) if r.hit]  # disk hits: loaded, nothing compiled
    found: dict[str, ModuleResult] = {}

    def lookups(run, users: int) -> None:
        """Run one construction; record each key it looked up (``users``: planned compiles launching through it)."""
        _NpuModuleLookup.seen.clear()
        try:
            run()
        except Probe:
            pass
        by_key: dict[str, list[tuple[str, bool]]] = {}
        for key, filename, present in _NpuModuleLookup.seen:
            by_key.setdefault(key, []).append((filename, present))
        for key, files in by_key.items():
            name = ("npu_utils" if files[0][0] == tritoncompat.NPU_UTILS_FILE else
                    "precompiled.h" if files[0][0] in tritoncompat.NPU_HEADER_FILES else "launcher")
            m = found.setdefault(key, ModuleResult(name, key, any(present for _, present in files), 0))
            m.kernels += users if name != "npu_utils" else 0

    with tritoncompat.cache_scope(os.path.abspath(cache_dir), _NpuModuleLookup):
        lookups(tritoncompat.npu_utils, 0)
        for kernel in kernels:
            lookups(lambda: tritoncompat.npu_launcher(kernel), 1)
    return list(found.values())


@dataclass
class Planned:
    """A manifest's requests expanded into Triton's compiles under its target (activated in this process)."""

    manifest: Manifest
    target: Target
    requests: list[Request]
    compiles: list[Compile]


def expand_plan(manifest_path: str, mode: str = "auto") -> Planned:
    manifest = load(manifest_path)
    if manifest.backend == "npu" and get_target("npu", manifest.arch, mode).mode == "device":
        from . import npu  # on the node: its own SoC, one of the manifest's (fails closed where it cannot tell)

        manifest = npu.for_soc(manifest, npu.node_soc(manifest))
    target: Target = get_target(manifest.backend, manifest.arch, mode)
    target.activate()
    requests = plan(manifest).requests
    return Planned(manifest, target, requests, expand_all(requests))


def planned_keys(compiles: list[Compile]) -> dict[str, Compile]:
    """The cache key dir each compile is looked up under (Triton computes it; nothing is looked at on disk)."""
    keys = {}
    with tritoncompat.cache_scope(os.path.abspath(tritoncompat.cache_dir()), ProbeCacheManager):
        for c in compiles:
            p = lookup(resolve(c.kernel), c.specialization)
            if p is not None:
                keys.setdefault(p.key, c)
    return keys


def check(manifest_path: str, cache_dir: str, mode: str = "auto") -> WillHitReport:
    """For every compile the manifest plans, would this environment's runtime find it in ``cache_dir``?"""
    with tritoncompat.ascend_prints_to_stderr():
        return _check(manifest_path, cache_dir, mode)


def _check(manifest_path: str, cache_dir: str, mode: str) -> WillHitReport:
    planned = expand_plan(manifest_path, mode)
    manifest, requests, compiles = planned.manifest, planned.requests, planned.compiles
    report = WillHitReport(manifest.name, os.path.abspath(cache_dir), planned.target.describe())
    report.results = probe_all(compiles, cache_dir)
    report.autotune = probe_autotune_all(requests, cache_dir)
    if manifest.backend == "cuda" and tritoncompat.has_cuda_launchers():
        report.modules = probe_cuda_modules(compiles, report.results, cache_dir)
    elif manifest.backend == "npu":
        report.modules = probe_npu_modules(compiles, report.results, cache_dir)
    return report
