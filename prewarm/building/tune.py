"""`prewarm tune`: measure every tuning key a manifest plans, once, on this machine's device, into the autotune table
that builds ship (prewarm.building.autotune owns the table and the planned keys).

A ``--mode device`` build into a scratch dir compiles the plan in parallel, then runs each provider's ``run`` with
TRITON_CACHE_AUTOTUNING=1: Triton's own Autotuner benchmarks every planned key on real tensors of the planned shapes,
with its own prune and perf-model hooks, and keeps each result in the scratch dir; each planned key's result is then
read back from the key dir Triton computes for it (the same probe the build writes through). Keys no provider call
makes (function entries, recordings) are reported as not measured. Where the plan makes no key (Ascend: pinned configs,
and triton-ascend 3.2 keeps no results) the table is written without rows and no device is needed. A tune given its
own ``cache_dir`` keeps it, so one stopped part way (a command's time limit, a lost node) resumes there: the build
skips what is compiled, and Triton's Autotuner reads the results it already kept instead of benchmarking again.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import backends, tritoncompat
from .. import devices
from .autotune import Table, TunedResult, TunedRow, measured, planned_tunings, read_table, write_table
from .build import build
from ..errors import BuildError, EnvironmentProblem
from ..planning.manifest import load
from ..planning.plan import manifest_device, plan


@dataclass
class TuneReport:
    manifest: str
    output: str
    device: str
    rows: list[TunedRow] = field(default_factory=list)
    not_measured: list[TunedResult] = field(default_factory=list)  # planned keys the device run did not tune
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"manifest": self.manifest, "output": self.output, "device": self.device, "measured": len(self.rows),
                "not_measured": [r.to_json() for r in self.not_measured], "notes": self.notes,
                "seconds": round(self.seconds, 3)}  # fmt: skip


def this_device(backend: str) -> str | None:
    """The accelerator's name as torch reports it here (what table rows are keyed by), None without one."""
    import torch

    if backend == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError:
            return None
        return torch.npu.get_device_name(0) if torch.npu.is_available() else None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def tune(manifest_path: str | os.PathLike, output: str | os.PathLike, workers: int | None = None,
         work_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> TuneReport:
    """Measure every planned tuning key of the manifest on this machine's device and write the table to ``output``
    (rows of other devices already in it are kept). The manifest's own table is not read: a scratch cache dir is
    built with ``--mode device``, so Triton benchmarks every key: ``cache_dir``, kept (resumable), else a fresh one
    under ``work_dir``, removed afterwards."""
    start = time.perf_counter()
    m = load(manifest_path)
    name = this_device(m.backend)  # asked before a target's device profile answers torch's queries in its place
    # on the device, its own target; without one, planning still needs none (the plan may make no tuning key)
    m, target = backends.select(m, "device") if name is not None else backends.plan_targets(m, "offline")[0]
    target.activate()
    tunings = planned_tunings(plan(m).requests)
    if m.device is not None:
        wanted = devices.lookup(manifest_device(m), f"{m.path}: target").name
        if name is not None and name != wanted:
            raise EnvironmentProblem(f"tune: this machine's device is {name!r}, but {m.path} targets {wanted!r} "
                                     f"(target.device): tune on the manifest's device")
        name = name or wanted
    if name is None and m.backend == "npu":
        name = m.arch  # an Ascend device is named by its SoC (torch.npu.get_device_name), the manifest's arch
    report = TuneReport(m.name, str(Path(output).resolve()), name or "unknown")
    existing = read_table(output) if Path(output).is_file() else Table(Path(output).resolve())
    table = Table(Path(output).resolve(), [r for r in existing.rows if r.device != report.device],
                  {"manifest": m.name, "device": report.device, "triton": tritoncompat.triton_distribution()[1]},
                  existing.pinned)  # pins are reviewed choices: kept, and their kernels get no measured rows
    measurable = [t for t in tunings if not t.problem]
    if measurable and target.mode != "device":
        raise EnvironmentProblem(f"tune: {len(measurable)} planned tuning keys need the device to be benchmarked on, "
                                 f"and this machine has none ({m.backend}): run it on a "
                                 f"{report.device if m.device else m.arch} node")
    if not tunings:
        report.notes.append("no planned call is autotuned with results Triton can keep on disk (pinned configs, or "
                            "a Triton without cache_results): the table has no rows for this device")
    cache = Path(cache_dir) if cache_dir is not None else Path(tempfile.mkdtemp(prefix="prewarm-tune-", dir=work_dir))
    try:
        if measurable:
            built = build(m, cache, workers=workers, mode="device", use_table=False)
            report.notes += built.notes
            if not built.ok:
                first = built.failed[0]
                raise BuildError(f"tune: {len(built.failed)} of {len(built.results)} compiles of the device build "
                                 f"failed (first: {first.label}: {(first.message.splitlines() or [''])[0]})")
        report.rows, report.not_measured = measured(tunings, cache, report.device)
        report.rows = [r for r in report.rows if existing.find_pin(report.device, r.kernel) is None]
    finally:
        if cache_dir is None:
            shutil.rmtree(cache, ignore_errors=True)
    table.rows += report.rows
    write_table(table)
    report.seconds = time.perf_counter() - start
    return report
