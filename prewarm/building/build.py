"""Build: a manifest's plan into a Triton cache dir, in parallel worker processes, idempotently.

The parent plans, expands every request into Triton's own compile requests under the target, and probes the
cache (the will-hit probe: no compile); only the missing ones go to a process pool, where each worker
replays them with ``JITFunction.preload`` into the cache dir. A second build of the same manifest therefore
compiles nothing (the pool's forkserver is still started in the background while the parent plans: it cannot know
before probing that nothing is missing, and starting it late would put its imports back on the critical path).
The cache dir's build info (``CacheDir.build_info``) records what was built (the packer reads it). A kernel this
Triton cannot key (``plan.WillFail``) cannot be built: everything else is, and the report lists it (the CLI then
exits 12), so a container build step loses nothing it could have built.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from triton.runtime.cache import FileCacheManager

from .. import __version__, jit
from . import autotune, backends, keys, tritoncompat
from ..shipping import layouts
from .autotune import TableReport
from .backends import Target, npu
from ..shipping.cachedir import CacheDir
from ..errors import EnvironmentProblem, FingerprintMismatch, ManifestError, describe
from ..jit import JitRequest, Lookup
from ..planning.manifest import Manifest, load
from ..planning.plan import Compile, WillFail, manifest_device, manifest_device_name, plan_for, resolve
from .probe import probe_all
from ..providers import provider


@dataclass
class CompileResult:
    label: str
    kernel: str
    request: str  # Request.ident
    key: str | None  # the cache key dir
    status: str  # "compiled" | "present" | "failed"
    seconds: float = 0.0
    message: str = ""  # the compiler's message for a failure


@dataclass
class BuildReport:
    manifest: str
    digest: str
    cache_dir: str
    target: str
    workers: int
    requests: int  # planned requests (before autotune expansion)
    results: list[CompileResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    autotune: TableReport | None = None  # the plan's tuning keys against the autotune table, results written
    key_drift: list[keys.KeyDrift] = field(default_factory=list)  # recorded requests keyed otherwise here (allowed)
    will_fail: list[WillFail] = field(default_factory=list)  # planned kernels this Triton cannot key: not built
    jit: list[Lookup] = field(default_factory=list)  # each planned module past Triton, built: its lookup after
    jit_dirs: dict[str, str] = field(default_factory=dict)  # layout -> the dir its modules were built into

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def failed(self) -> list[CompileResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def jit_failed(self) -> list[Lookup]:
        return [j for j in self.jit if not j.hit]

    @property
    def ok(self) -> bool:
        return not self.failed and not self.jit_failed

    def to_json(self) -> dict:
        return {
            "manifest": self.manifest,
            "digest": self.digest,
            "cache_dir": self.cache_dir,
            "target": self.target,
            "workers": self.workers,
            "requests": self.requests,
            "compiles": len(self.results),
            "compiled": self.count("compiled"),
            "present": self.count("present"),
            "failed": self.count("failed"),
            "seconds": round(self.seconds, 3),
            "notes": self.notes,
            "results": [asdict(r) for r in self.results],
            "autotune": self.autotune.to_json() if self.autotune is not None else None,
            "key_drift": [d.to_json() for d in self.key_drift],
            "will_fail": [w.to_json() for w in self.will_fail],
            "jit": [j.to_json() for j in self.jit],
            "jit_dirs": self.jit_dirs,
        }


class CountingCacheManager(FileCacheManager):
    """Triton's FileCacheManager that notes, per key, whether compile() found the kernel (a hit) or not."""

    lookups: list[tuple[str, bool]] = []

    def get_group(self, filename):
        group = super().get_group(filename)
        if filename.endswith(".json") and not filename.endswith(".autotune.json"):
            CountingCacheManager.lookups.append((self.key, bool(group and filename in group)))
        return group


# --- worker side ------------------------------------------------------------------------------------------------


_WORKER_TARGET: Target | None = None


def _init(cache_dir: str, target: Target, env: dict[str, str]) -> None:
    """Once per worker: the parent's environment as it is now (the forkserver froze the one it started with), the
    cache dir, the counting cache manager, the target's driver."""
    global _WORKER_TARGET
    os.environ.clear()
    os.environ.update(env)
    _WORKER_TARGET = target
    tritoncompat.set_cache_dir(cache_dir)
    tritoncompat.set_cache_manager(CountingCacheManager)
    target.prepare_build()
    target.activate()


NO_DEVICE_HINT = (" (the kernel's module failed to import with no device profile active: where it asks the device at "
                  "import, name the node's with [target] device = \"H200\" (prewarm.devices), or record with this "
                  "prewarm, whose recordings name their device)")


def _compile(target: Target, kernel: str, specialization: str) -> tuple[str, str | None, float, str]:
    """(status, key, seconds, message) for one compile in this worker."""
    CountingCacheManager.lookups.clear()
    start = time.perf_counter()
    try:
        fn = resolve(kernel)
    except Exception as e:  # its module failed to import: fla, sglang ask the device at import
        hint = "" if target.device_profile else NO_DEVICE_HINT
        return "failed", None, time.perf_counter() - start, describe(e)[-4000:] + hint
    try:
        target.compile(fn, specialization)
    except Exception as e:
        key = CountingCacheManager.lookups[0][0] if CountingCacheManager.lookups else None
        return "failed", key, time.perf_counter() - start, describe(e)[-4000:]
    seconds = time.perf_counter() - start
    if not CountingCacheManager.lookups:
        return "failed", None, seconds, "Triton did not look the kernel up (nothing was compiled)"
    key, hit = CountingCacheManager.lookups[0]
    return ("present" if hit else "compiled"), key, seconds, ""


def _worker_task(args: tuple) -> tuple[str, str | None, float, str]:
    return _compile(_WORKER_TARGET, *args)


# --- parent side ------------------------------------------------------------------------------------------------


Progress = Callable[[CompileResult, int, int], None]


def build(
    manifest: Manifest | str | os.PathLike,
    cache_dir: str | os.PathLike,
    workers: int | None = None,
    mode: str = "auto",
    progress: Progress | None = None,
    tuned: str | os.PathLike | None = None,
    use_table: bool = True,
    *,
    max_compiles: int | None = None,
    allow_key_drift: bool = False,
) -> BuildReport:
    """Compile every planned request that ``cache_dir`` lacks; ``progress(result, done, total)`` after each. Then
    the autotune table (``tuned``, else the manifest's ``[target] tuned``; none with ``use_table=False``) gives every
    planned tuning key it covers its result file, before a device build runs the providers (which then benchmark
    only what the table lacks). Refused before compiling: a plan of more than ``max_compiles`` compiles
    (:func:`check_plan`), and a recorded request whose recorded key this host does not reproduce (the recording's
    node would not find what this build makes: :mod:`prewarm.building.keys`), unless ``allow_key_drift``."""
    start = time.perf_counter()
    m = manifest if isinstance(manifest, Manifest) else load(manifest)
    if m.backend == "npu" and len(npu.socs(m)) > 1:
        return _build_socs(m, cache_dir, workers, mode, progress, tuned, use_table, max_compiles=max_compiles,
                           allow_key_drift=allow_key_drift)
    cache = os.path.abspath(cache_dir)
    layout = CacheDir(cache)
    try:
        layout.meta.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EnvironmentProblem(f"--cache-dir {cache}: cannot create it: {e.strerror}") from e
    workers = max(1, workers or os.cpu_count() or 1)
    target = backends.get_target(m.backend, m.arch, mode, manifest_device(m), m.libcuda_dirs)
    with layout.building():
        target.prepare_build()
        start_workers()
        planned = plan_for(m, target)
        target.toolchain()  # computed once here, handed to every worker with the target
        compiles = planned.compiles
        report = BuildReport(m.name, m.digest, cache, target.describe(), workers, len(planned.requests))
        report.will_fail = planned.will_fail
        report.notes = target.notes()
        other = tritoncompat.differs_from(m.triton, f"{m.path.name} ([target] triton)")
        if other:
            report.notes.append(f"{other}: the cache is keyed by this Triton, so only nodes running it find it")
        results: list[CompileResult | None] = [None] * len(compiles)
        done = 0

        def finish(i: int, result: CompileResult) -> None:
            nonlocal done
            results[i], done = result, done + 1
            if progress:
                progress(result, done, len(compiles))

        check_plan(planned, max_compiles)
        probes = probe_all(compiles, cache)
        report.key_drift = keys.check(planned.requests, compiles, [p.key for p in probes])
        if report.key_drift and not allow_key_drift:
            raise FingerprintMismatch(keys.refusal(report.key_drift, planned.requests))
        if keys.unchecked(planned.requests):
            report.notes.append(f"{keys.unchecked(planned.requests)} recorded requests carry no key (recorded by an "
                                f"older prewarm): not checked against what this host computes")
        missing = []
        for i, (c, probe) in enumerate(zip(compiles, probes)):
            if probe.hit:
                finish(i, CompileResult(c.label, c.kernel, c.request, probe.key, "present"))
            else:
                missing.append(i)
        if missing:
            compile_into([compiles[i] for i in missing], cache, target, min(workers, len(missing)),
                         lambda j, result: finish(missing[j], result))
        report.results = [r for r in results if r is not None]
        providers = [provider(k.ref) for k in m.kernels if k.kind == "provider"]
        table = autotune.table_path(m, tuned) if use_table else None
        if report.ok and table is not None:
            device = manifest_device_name(m, "--tuned" if tuned is not None else "target.tuned")
            report.autotune = autotune.apply_table(table, device, autotune.planned_tunings(planned.requests), cache,
                                                   str(m.path))
            report.notes.append(report.autotune.summary())
        if report.ok:
            report.notes += target.after_build(providers, m.spec(), cache, compiles)
        if report.ok and planned.jit:
            build_jit(m, planned.jit, target, cache, report)
        report.seconds = time.perf_counter() - start
        layout.write_build_info(_build_info(m, target, report))
    return report


def jit_dir(cache_dir: str | os.PathLike, layout: str) -> Path:
    """Where a build into ``cache_dir`` puts the modules past Triton of one layout: beside it, ``<cache_dir>.<layout>``
    (each its own cache dir, packed and shipped as its own bundle)."""
    return Path(f"{os.path.abspath(cache_dir)}.{layout}")


def build_jit(m: Manifest, requests: list[JitRequest], target: Target, cache_dir: str, report: BuildReport) -> None:
    """Each planned module past Triton, built by its library's own code for the target's arch with this image's
    toolchain (no accelerator), into :func:`jit_dir`; the dir's build info records the library's toolchain factors
    (the bundle's fingerprint: a node differing in one would rebuild)."""
    for name, group in jit.by_library(requests).items():
        lib = jit.library(name)
        root = jit_dir(cache_dir, lib.layout)
        out = CacheDir(root)
        out.meta.mkdir(parents=True, exist_ok=True)
        layouts.mark(root, lib.layout)
        with out.building():
            lookups = lib.build(group, root, target.arch)
            report.jit += lookups
            report.jit_dirs[lib.layout] = str(root)
            out.write_build_info({
                "prewarm_version": __version__,
                "manifest": {"name": m.name, "path": str(m.path), "digest": m.digest},
                "target": {"backend": target.backend, "arch": target.arch, "mode": "offline"},
                "fingerprint": lib.toolchain(target.arch),
                "jit": [x.to_json() for x in lookups],
            })


def _build_socs(m: Manifest, cache_dir: str | os.PathLike, workers: int | None, mode: str,
                progress: Progress | None, tuned: str | os.PathLike | None, use_table: bool, **refusals) -> BuildReport:
    """An npu manifest listing several SoCs: every key contains the SoC, so the sets share nothing but the source.
    Offline, one complete cache dir per SoC, ``<cache_dir>/<SoC>`` (each packed and shipped as its own bundle,
    named ``<name>-<SoC>``); on a node (device mode), only the node's SoC, into ``cache_dir`` itself."""
    if backends.get_target(m.backend, m.arch, mode).mode == "device":
        return build(npu.for_soc(m, npu.node_soc(m)), cache_dir, workers, mode, progress, tuned, use_table,
                     **refusals)
    reports = [build(npu.for_soc(m, soc), Path(cache_dir, soc), workers, mode, progress, tuned, use_table, **refusals)
               for soc in npu.socs(m)]
    out = BuildReport(m.name, m.digest, os.path.abspath(cache_dir), "; ".join(r.target for r in reports),
                      reports[0].workers, sum(r.requests for r in reports))
    for soc, r in zip(npu.socs(m), reports):
        out.results += [replace(x, label=f"{soc}: {x.label}") for x in r.results]
        out.key_drift += r.key_drift
        out.will_fail += [w for w in r.will_fail if w not in out.will_fail]  # a kernel's key holds no SoC
        out.notes += [n for n in r.notes if n not in out.notes]
        out.seconds += r.seconds
    return out


def check_plan(planned, max_compiles: int | None) -> None:
    """Refuse, before anything is probed or compiled, a plan of more than ``max_compiles`` compiles, naming the
    count and the manifest entries and kernels it comes from (ManifestError: the manifest asks for too much)."""
    n = len(planned.compiles)
    if max_compiles is None or n <= max_compiles:
        return
    top = "; ".join(f"{c.source}: {c.kernel.rsplit(':', 1)[-1]} {c.compiles} compiles from {c.requests} requests"
                    + (f" ({c.closing} added by closing)" if c.closing else "") for c in planned.counts()[:3])
    raise ManifestError(f"{planned.manifest.path}: the plan has {n} compiles from {len(planned.requests)} requests, "
                        f"more than --max-compiles {max_compiles}; most from {top}: expected a narrower manifest "
                        f"(close = [names] instead of true, fewer dtypes), or a higher --max-compiles")


_PRELOAD = ["torch", "triton", "triton.compiler", __name__]  # the forkserver's imports (a missing one is skipped)


def start_workers(start_method: str = "forkserver") -> multiprocessing.context.BaseContext:
    """The pool's context; for a forkserver, started now (idempotent), so that its imports run while the parent
    plans (docs/measurements.md: bench/build_scaling.py)."""
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
        from multiprocessing import forkserver

        forkserver.ensure_running()
    return ctx


def compile_into(compiles: list[Compile], cache: str, target: Target, workers: int,
                 finish: Callable[[int, CompileResult], None], start_method: str = "forkserver") -> None:
    """Compile each of ``compiles`` into ``cache`` in a pool of ``workers`` processes (no presence check);
    ``finish(index, result)`` as each completes.

    Workers fork from a forkserver that imported torch, triton and this module once, instead of each importing them
    at once (what that saves: bench/build_scaling.py). Nothing that depends on the target or a device is imported
    there (fla, say, reads the device at import): each worker activates its target in ``_init``.
    ``start_method="spawn"``: each worker imports on its own (that benchmark's baseline)."""
    ctx = start_workers(start_method)
    initargs = (cache, target, dict(os.environ))
    with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=initargs) as pool:
        futures = {pool.submit(_worker_task, (c.kernel, c.specialization)): i for i, c in enumerate(compiles)}
        for fut in cf.as_completed(futures):
            i = futures[fut]
            c = compiles[i]
            try:
                status, key, seconds, message = fut.result()
            except Exception as e:  # a worker died (out of memory, a crash in the compiler)
                status, key, seconds, message = "failed", None, 0.0, f"worker process failed: {type(e).__name__}: {e}"
            finish(i, CompileResult(c.label, c.kernel, c.request, key, status, round(seconds, 4), message))


def _build_info(m: Manifest, target: Target, report: BuildReport) -> dict:
    """What this cache dir holds and was built under: manifest, fingerprint, every request's key."""
    return {
        "prewarm_version": __version__,
        "manifest": {"name": m.name, "path": str(m.path), "digest": m.digest},
        "target": {"backend": target.backend, "arch": target.arch, "mode": target.mode},
        "fingerprint": target.toolchain(),
        "requests": [
            {"label": r.label, "kernel": r.kernel, "request": r.request, "key": r.key, "status": r.status}
            for r in report.results
        ],
    }
