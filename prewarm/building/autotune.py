"""Autotune results as shipped data: the tuning keys a plan makes, the table `prewarm tune` measures them into on one
device, and the result files an offline build writes from that table, so that no node benchmarks anything.

Triton's Autotuner keeps a result per tuning key in ``<key dir>/<fn>.autotune.json`` (``check_disk_cache``): the key
dir hashes Triton, the backend, the kernel's source, the cache-invalidating env vars, ``str(tuning_key)`` and the
pruned configs; the file holds ``{"key": tuning_key, "configs_timings": [[config.__dict__, [p50, p20, p80]], ...]}``
and the reader takes the fastest entry. A node reads it when the Autotuner keeps results (``cache_results=True``,
or TRITON_CACHE_AUTOTUNING=1 when its module was imported), and then benchmarks nothing for that key.

- :func:`planned_tunings`: for every planned call of an autotuned kernel, a copy of its Autotuner computes the tuning
  key, prunes its configs (its own prune / perf-model hooks) and asks the cache for the file; the probe stops it at
  that lookup (prewarm.building.probe), which gives the key dir Triton will look in, computed by Triton. A recorded compile
  (``prewarm record``) is one config of such a call: its constexprs and pointer dtypes are known, its runtime ints
  only by class and its shapes not at all. Its tuning key is derived when every key argument is a constexpr (the
  usual case: head counts and dims); otherwise it is reported as unknown. A recording can never be benchmarked.
- The table (TOML, one ``[[tuned]]`` per device, kernel and tuning key, every config with its timings; written by
  ``prewarm tune`` (prewarm.building.tune), reviewed like code) and :func:`apply_table`: the fastest config of each planned key, written as
  Triton's own result file under the key dir Triton computes, through the cache dir's atomic writer.
- Pins (``[[pinned]]`` rows of the same table: one config per device and kernel, chosen and reviewed by hand, with
  where the choice comes from and no timings): for a Triton that keeps no results (triton-ascend 3.2 has no
  ``cache_results``: every process benchmarks at its first call of each key) and for choices made without a device
  to measure on. The plan expands a pinned kernel's calls into that config alone (:func:`pins_for`, used by
  prewarm.planning.plan), and the guard gives the kernel's Autotuner that config alone before its first call in every
  serving process (:func:`pin_chooser`): an Autotuner with one config runs it without benchmarking, on every
  Triton. Where it reads them: the manifest's ``[target] tuned`` table, the manifest being PREWARM_GUARD_PLAN.
- :func:`measured`: the rows of what Triton's Autotuner kept in a cache dir for the planned keys (``prewarm.building.tune``
  measures on the device that way).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import tritoncompat
from ..shipping.cachedir import write_atomic
from ..errors import ManifestError
from ..planning.manifest import Manifest
from ..planning.pins import PinnedRow, load_table, parse_pins, pinned_config
from ..planning.plan import Request, decode, resolve
from .probe import Probe, ProbeCacheManager

TABLE_HEADER = """\
# Autotune table: what each autotuned kernel runs on the device named in each row.
# [[pinned]]: one config per device and kernel, chosen by hand and reviewed (source: where the choice comes from; no
# timings). The plan compiles that config alone, and the guard (PREWARM_GUARD with PREWARM_GUARD_PLAN = the manifest
# naming this table) gives the kernel's Autotuner that config alone before its first call in every serving process,
# for every tuning key: it never benchmarks. config: the meta-parameters the kernel's configs set, and num_warps,
# num_stages, num_ctas, maxnreg.
# [[tuned]]: measured by `prewarm tune` (re-run it; do not edit by hand), one per device, kernel and Triton's tuning
# key (the key arguments' values, then each tensor argument's dtype): every config Triton benchmarked after its
# pruning, as str(config), with its time in ms (median, 20th and 80th percentile). `prewarm build` writes the fastest
# as Triton's own result file for every planned key (Triton 3.4+; triton-ascend 3.2 keeps no results: pin instead).
"""




# --- the tuning keys a plan makes --------------------------------------------------------------------------------


@dataclass
class PlannedTuning:
    """One tuning key of a plan: where Triton looks for its kept result, and what it would benchmark."""

    label: str  # the first planned request with this tuning key
    kernel: str  # "module:qualname" of the autotuned kernel's function
    key: str  # the cache key dir the Autotuner looks in ("-": not computed, see ``problem``)
    filename: str  # "<fn>.autotune.json"
    tuning_key: str  # str() of Triton's tuning key, as Triton hashes it ("" when unknown)
    configs: list = field(default_factory=list)  # Triton Configs benchmarked after pruning (live objects)
    keeps: bool = True  # does this process's Autotuner read kept results (cache_results / TRITON_CACHE_AUTOTUNING)
    key_value: Any = None  # the tuning key itself (the result file's "key")
    problem: str = ""  # why no key was computed: a recorded runtime-int key argument, a hook failing on meta tensors

    @property
    def config_names(self) -> list[str]:
        return [str(c) for c in self.configs]

    def to_json(self) -> dict:
        return {"label": self.label, "kernel": self.kernel, "key": self.key, "tuning_key": self.tuning_key,
                "configs": len(self.configs), "keeps_results": self.keeps, "problem": self.problem}  # fmt: skip


class _Unknown(Exception):
    """A recorded compile whose tuning key the recording does not determine."""


def _pointer_dtypes() -> dict[str, Any]:
    """Triton's pointer type names ("*bf16") -> torch dtypes, for the dtypes a manifest can name."""
    import torch

    from ..planning.manifest import TENSOR_DTYPES

    return {tritoncompat.pointer_type(n): getattr(torch, n) for n in TENSOR_DTYPES}


def _recorded_call(kernel, data: str) -> tuple[tuple, dict]:
    """The call a recorded compile of an autotuned kernel stands for, as far as its tuning key goes: pointers as
    ``meta`` tensors of their dtype, constexprs as recorded, ints as a value of their class; the parameters the
    Autotuner's configs or Heuristics choose are left to them. Raises _Unknown when a key argument is a runtime
    int (the recording holds its specialization class, not its value) or the data is not understood."""
    import torch

    jit, tuner = tritoncompat.jit_function(kernel), tritoncompat.autotuner_of(kernel)
    chosen, wrapper = {k for c in tuner.configs for k in c.kwargs}, kernel
    while wrapper is not jit:
        chosen |= set(getattr(wrapper, "values", {}))  # Heuristics
        wrapper = wrapper.fn
    spec = tritoncompat.parse_specialization(data, jit.arg_names)
    pointers = _pointer_dtypes()
    args, kwargs = [], {}
    for name in jit.arg_names:
        if name in chosen:
            continue
        arg = spec.args.get(name)
        if arg is None:
            raise _Unknown(f"argument {name} is not in the recorded data (a tuple argument?)")
        if name in tuner.keys and arg.type != "constexpr":
            raise _Unknown(f"key argument {name} is a runtime {arg.type}: a recording holds its specialization "
                           f"class, not its value")
        if arg.type == "constexpr":
            value = arg.value
        elif arg.type.startswith("*"):
            dtype = pointers.get(arg.type.replace("*k", "*"))
            if dtype is None:
                raise _Unknown(f"argument {name}: pointer type {arg.type} names no tensor dtype prewarm knows")
            value = torch.empty(1, dtype=dtype, device="meta")
        elif arg.type[:1] in "iu":
            value = 16 if ("tt.divisibility", 16) in arg.attrs else 17
        else:
            value = 1.0
        if kwargs or len(args) < jit.arg_names.index(name):  # after a parameter left out: by name
            kwargs[name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def _call_of(r: Request):
    """(kernel object, args, kwargs) of a planned request as its Autotuner's ``run`` would see it."""
    kernel = resolve(r.kernel)
    if r.specialization is not None:
        return kernel, *_recorded_call(kernel, r.specialization)
    args = tuple(decode(a) for a in r.args)
    named = {k: decode(v) for k, v in r.kwargs.items()}
    if not args:  # a manifest's function entry names every argument: the usual positional call (the tuning key
        # lists tensor dtypes in argument order), up to the first parameter it leaves out (an autotuned one)
        for p in tritoncompat.jit_function(kernel).arg_names:
            if p not in named:
                break
            args += (named.pop(p),)
    return kernel, args, named


def _planned_tuning(r: Request) -> PlannedTuning | None:
    """This request's tuning key and key dir (None: the call is not tuned, or this Triton keeps nothing on disk)."""
    if r.specialization is not None and tritoncompat.autotuner_of(resolve(r.kernel)) is None:
        return None  # a recorded compile of a kernel that is not autotuned
    try:
        kernel, args, kwargs = _call_of(r)
    except _Unknown as e:
        tuner = tritoncompat.autotuner_of(resolve(r.kernel))
        return PlannedTuning(r.label, tritoncompat.kernel_ref(tuner), "-", "", "",
                             keeps=tritoncompat.keeps_results(tuner), problem=f"recorded compile: {e}")
    return _tuning(r.label, kernel, args, kwargs)


def _tuning(label: str, kernel, args: tuple, kwargs: dict) -> PlannedTuning | None:
    """One call's tuning key and key dir, under a probing cache manager (None: not tuned, or not keepable)."""
    call = tritoncompat.autotuned_call(kernel, args, kwargs)
    if call is None:
        return None
    tuner, args, kwargs = call
    ref, keeps = tritoncompat.kernel_ref(tuner), tritoncompat.keeps_results(tuner)
    seen = tritoncompat.Tuning()
    try:
        tritoncompat.first_tuning(tuner, args, kwargs, seen)
    except Probe as p:
        if not p.filename.endswith(".autotune.json"):
            return None  # one config: straight to the kernel's own lookup, nothing is tuned
        return PlannedTuning(label, ref, p.key, p.filename, str(seen.key), seen.configs, keeps, seen.key)
    except tritoncompat.NoBenchmark:
        return None  # configs with pre_hooks or no tuning key: Triton never keeps these
    except Exception as e:  # e.g. a prune or perf-model hook failing on meta tensors: said, not fatal
        return PlannedTuning(label, ref, "-", "", "", keeps=keeps,
                             problem=f"cannot compute the tuning key: {type(e).__name__}: {e}")
    return None


def call_tuning(label: str, kernel, args: tuple, kwargs: dict) -> PlannedTuning | None:
    """The tuning key and key dir of one launch as a server makes it (``kernel[grid](*args, **kwargs)``), computed
    as :func:`planned_tunings` computes a plan's: traffic checks against the plan with it. Target active."""
    with tritoncompat.cache_scope(os.path.abspath(tritoncompat.cache_dir()), ProbeCacheManager):
        return _tuning(label, kernel, args, kwargs)


def planned_tunings(requests: list[Request]) -> list[PlannedTuning]:
    """Every tuning key the requests make, once each (many calls share one: the key leaves out what the Autotuner
    ignores), in plan order. The target must be active (the key dir hashes its backend); nothing is read or made
    in any cache dir."""
    found: dict[tuple[str, str], PlannedTuning] = {}
    with tritoncompat.cache_scope(os.path.abspath(tritoncompat.cache_dir()), ProbeCacheManager):
        for r in requests:
            t = _planned_tuning(r)
            if t is not None:
                found.setdefault((t.kernel, t.problem or t.key), t)
    return list(found.values())


def kept_timings(cache_dir: str | os.PathLike, t: PlannedTuning) -> dict[str, list[float]]:
    """The result Triton kept for ``t`` in ``cache_dir``, as {str(config): [p50, p20, p80]}; {} when there is none.
    Raises ValueError (and the like) when the file is not one Triton wrote."""
    from triton import Config

    path = Path(cache_dir, t.key, t.filename)
    if not t.filename or not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    return {str(Config(**config)): [float(x) for x in timing] for config, timing in doc["configs_timings"]}


# --- the table ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TunedRow:
    """One measured tuning key: each config (``str(config)``) and its [p50, p20, p80] in ms."""

    device: str
    kernel: str
    tuning_key: str
    timings: dict[str, list[float]]
    label: str = ""

    @property
    def best(self) -> str:
        """The config Triton's reader picks: the least timing (``min`` over the [p50, p20, p80] lists)."""
        return min(self.timings, key=self.timings.get)


@dataclass
class Table:
    path: Path
    rows: list[TunedRow] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    pinned: list[PinnedRow] = field(default_factory=list)

    def find(self, device: str, kernel: str, tuning_key: str) -> TunedRow | None:
        return next((r for r in self.rows if (r.device, r.kernel, r.tuning_key) == (device, kernel, tuning_key)),
                    None)

    def find_pin(self, device: str, kernel: str) -> PinnedRow | None:
        return next((r for r in self.pinned if (r.device, r.kernel) == (device, kernel)), None)

    def devices(self) -> list[str]:
        return sorted({r.device for r in [*self.rows, *self.pinned]})


def read_table(path: str | os.PathLike) -> Table:
    """Parse and check a table (ManifestError naming the file, the row and the key; exit 3)."""
    path = Path(path)
    doc = load_table(path)
    extra = sorted(set(doc) - {"meta", "tuned", "pinned"})
    if extra:
        raise ManifestError(f"{path}: {extra[0]}: no such key in an autotune table (expected [meta], [[pinned]] and "
                            f"[[tuned]])")
    meta, rows = doc.get("meta", {}), doc.get("tuned", [])
    if not isinstance(meta, dict) or not isinstance(rows, list):
        raise ManifestError(f"{path}: expected a [meta] table and an array of [[tuned]] tables")
    table = Table(path, meta=meta, pinned=parse_pins(path, doc.get("pinned", [])))
    seen = set()
    for i, row in enumerate(rows):
        where = f"{path}: tuned[{i}]"
        if not isinstance(row, dict):
            raise ManifestError(f"{where} = {row!r}: expected a table")
        unknown = sorted(set(row) - {"device", "kernel", "tuning_key", "label", "timings"})
        if unknown:
            raise ManifestError(f"{where}.{unknown[0]}: no such key (known: device, kernel, tuning_key, label, "
                                f"timings)")
        for key in ("device", "kernel", "tuning_key"):
            if not isinstance(row.get(key), str) or not row[key]:
                raise ManifestError(f"{where}.{key} = {row.get(key)!r}: expected a non-empty string")
        timings = row.get("timings")
        if not isinstance(timings, list) or not timings:
            raise ManifestError(f"{where}.timings = {timings!r}: expected a non-empty list of [config, p50, p20, p80]")
        parsed: dict[str, list[float]] = {}
        for j, t in enumerate(timings):
            ok = (isinstance(t, list) and len(t) == 4 and isinstance(t[0], str)
                  and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in t[1:]))
            if not ok or t[0] in parsed:
                raise ManifestError(f"{where}.timings[{j}] = {t!r}: expected [\"<str(config)>\", p50, p20, p80] "
                                    f"(ms), each config once")
            parsed[t[0]] = [float(x) for x in t[1:]]
        ident = (row["device"], row["kernel"], row["tuning_key"])
        if ident in seen:
            raise ManifestError(f"{where}: a second row for device {ident[0]!r}, kernel {ident[1]}, tuning key "
                                f"{ident[2]}: expected one row per device, kernel and tuning key")
        seen.add(ident)
        if table.find_pin(ident[0], ident[1]) is not None:
            raise ManifestError(f"{where}: kernel {ident[1]} is pinned for device {ident[0]!r} too: expected a kernel "
                                f"pinned or measured on a device, not both")
        table.rows.append(TunedRow(*ident, parsed, row.get("label", "")))
    return table


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    raise TypeError(f"no TOML form for {value!r}")


def format_table(table: Table) -> str:
    """The table as TOML, rows sorted by device, kernel and tuning key: a re-tune diffs row by row."""
    lines = [TABLE_HEADER, "[meta]"]
    lines += [f"{k} = {_toml(v)}" for k, v in sorted(table.meta.items())]
    for p in sorted(table.pinned, key=lambda r: (r.device, r.kernel)):
        config = ", ".join(f"{k if k.isidentifier() else _toml(k)} = {_toml(v)}" for k, v in p.config.items())
        lines += ["", "[[pinned]]", f"device = {_toml(p.device)}", f"kernel = {_toml(p.kernel)}",
                  f"config = {{ {config} }}", f"source = {_toml(p.source)}"]
        lines += [f"reason = {_toml(p.reason)}"] if p.reason else []
    for r in sorted(table.rows, key=lambda r: (r.device, r.kernel, r.tuning_key)):
        lines += ["", "[[tuned]]", f"device = {_toml(r.device)}", f"kernel = {_toml(r.kernel)}",
                  f"tuning_key = {_toml(r.tuning_key)}"]
        if r.label:
            lines.append(f"label = {_toml(r.label)}  # the first planned call with this key")
        lines.append(f"# fastest: {r.best}")
        lines.append("timings = [")
        lines += [f"    [{_toml(c)}, {', '.join(_toml(round(x, 5)) for x in t)}]," for c, t in r.timings.items()]
        lines.append("]")
    return "\n".join(lines) + "\n"


def write_table(table: Table) -> None:
    table.path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(table.path, format_table(table).encode())


# --- from the table into a cache dir ------------------------------------------------------------------------------


@dataclass
class TunedResult:
    """One planned tuning key against the table."""

    tuning: PlannedTuning
    status: str  # "written" | "present" | "in table" (a plan: nothing written) | "pinned" | "absent" | "stale" |
    # "unknown"
    detail: str

    @property
    def covered(self) -> bool:
        return self.status in ("written", "present", "in table", "pinned")

    def to_json(self) -> dict:
        return {**self.tuning.to_json(), "status": self.status, "detail": self.detail}


@dataclass
class TableReport:
    """A plan's tuning keys against a table (``path``) for ``device``: what was written, what the table lacks."""

    path: str
    device: str
    manifest: str = "MANIFEST"  # its path, for the command that makes a missing table
    results: list[TunedResult] = field(default_factory=list)
    missing_file: bool = False  # the manifest names a table that does not exist (yet)
    other_devices: dict[str, int] = field(default_factory=dict)  # rows the table holds for other devices
    measured_under: str = ""  # the Triton version the table's [meta] says it was measured under

    @property
    def uncovered(self) -> list[TunedResult]:
        return [r for r in self.results if not r.covered]

    def summary(self) -> str:
        """One line for plan and build: how many planned tuning keys the table covers, what is left."""
        n = len(self.results)
        if self.missing_file:
            return (f"autotune table {self.path}: no such file (make it with `prewarm tune {self.manifest} -o "
                    f"{self.path}` on a node with the device, {self.device}): the node benchmarks all {n} planned "
                    f"tuning keys")
        if not n:
            return (f"autotune table {self.path} ({self.device}): no planned call makes a tuning key Triton keeps "
                    f"results for (pinned kernels are listed apart)")
        done = {s: sum(r.status == s for r in self.results) for s in ("written", "present", "in table", "pinned")}
        text = f"autotune table {self.path} ({self.device}): {n - len(self.uncovered)} of {n} planned tuning keys"
        text += "".join(f", {v} {s}" for s, v in done.items() if v)
        if self.uncovered:
            text += f"; {len(self.uncovered)} not covered (the node benchmarks these)"
        if self.other_devices:
            text += "; rows for other devices not used: " + ", ".join(f"{d} ({n})" for d, n in
                                                                     sorted(self.other_devices.items()))
        measured = tritoncompat.version_series(self.measured_under)
        if measured and measured != tritoncompat.release().series:  # result files are keyed by the running Triton
            text += (f"; measured under Triton {self.measured_under}, used for {tritoncompat.release()}: winners can "
                     f"move with a compiler release (re-run `prewarm tune` under it)")
        return text

    def to_json(self) -> dict:
        return {"path": self.path, "device": self.device, "missing_file": self.missing_file,
                "covered": len(self.results) - len(self.uncovered), "uncovered": len(self.uncovered),
                "other_devices": self.other_devices, "results": [r.to_json() for r in self.results]}  # fmt: skip


def table_path(manifest: Manifest, override: str | os.PathLike | None = None) -> Path | None:
    """The table a build of ``manifest`` uses: ``override`` (``--tuned``), else ``[target] tuned``, else none."""
    return Path(override).resolve() if override is not None else manifest.tuned


def result_file(t: PlannedTuning, timings: dict[str, list[float]]) -> bytes:
    """Triton's own result file for ``t``: its pruned configs, in its order, with their measured timings."""
    doc = {"key": t.key_value, "configs_timings": [(c.__dict__, timings[str(c)]) for c in t.configs
                                                   if not c.pre_hook]}  # fmt: skip
    return json.dumps(doc).encode()


def apply_table(path: Path, device: str, tunings: list[PlannedTuning], cache_dir: str | None,
                manifest: str = "MANIFEST") -> TableReport:
    """Each planned tuning key against the table at ``path`` for ``device``; with ``cache_dir``, the fastest config
    of each one the table covers is written there as Triton's result file (a plan passes None: nothing written).
    A row whose configs are not the ones the Autotuner benchmarks now (the kernel's config list changed since the
    table was measured) is ``stale`` and not used; so is every row of another device."""
    report = TableReport(str(path), device, manifest)
    if not path.is_file():
        report.missing_file = True
        report.results = [TunedResult(t, "absent", "no table file") for t in tunings]
        return report
    table = read_table(path)
    report.measured_under = str(table.meta.get("triton", ""))
    for d in table.devices():
        if d != device:
            report.other_devices[d] = sum(r.device == d for r in [*table.rows, *table.pinned])
    for t in tunings:
        pin = table.find_pin(device, t.kernel)
        if pin is not None:  # its Autotuner runs one config under the guard: no result file to write or read
            report.results.append(TunedResult(t, "pinned", f"pinned: {pin.describe()} ({pin.source})"))
            continue
        if t.problem:
            report.results.append(TunedResult(t, "unknown", t.problem))
            continue
        row = table.find(device, t.kernel, t.tuning_key)
        if row is None:
            report.results.append(TunedResult(t, "absent", f"the table has no row for {device}, this kernel and "
                                                           f"tuning key {t.tuning_key}"))
            continue
        now, measured = set(t.config_names), set(row.timings)
        if now != measured:
            what = sorted(now - measured)[:1] or sorted(measured - now)[:1]
            report.results.append(TunedResult(t, "stale", f"the table's {len(measured)} configs are not the "
                                                          f"{len(now)} the Autotuner benchmarks now (e.g. {what[0]}): "
                                                          f"re-run prewarm tune"))
            continue
        best = min((str(c) for c in t.configs), key=row.timings.get)
        if cache_dir is None:
            report.results.append(TunedResult(t, "in table", f"fastest: {best}"))
            continue
        target = Path(cache_dir, t.key, t.filename)
        data = result_file(t, row.timings)
        if target.is_file() and target.read_bytes() == data:
            report.results.append(TunedResult(t, "present", f"fastest: {best}"))
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, data, durable=False)
        report.results.append(TunedResult(t, "written", f"fastest: {best}"))
    return report


@dataclass
class AutotunedKernel:
    """One autotuned kernel a plan calls: its pin, or what a node does without one."""

    kernel: str  # "module:qualname"
    label: str  # the first planned call of it
    configs: list  # its Autotuner's configs (before any pruning)
    pin: PinnedRow | None
    keeps: bool  # this Triton can keep its results on disk (3.4+); triton-ascend 3.2 cannot

    @property
    def candidate(self) -> bool:
        """Is the pinned config one of the kernel's own configs (Triton's text of it)?"""
        return self.pin is not None and str(self.pin.triton_config()) in {str(c) for c in self.configs}

    def describe(self) -> str:
        n = len(self.configs)
        if self.pin is not None:
            which = "one of its" if self.candidate else "not one of its"
            return (f"runs {self.pin.describe()} alone under the guard ({which} {n} configs; {self.pin.source}): "
                    f"{n - self.candidate} configs not planned")
        if self.keeps:
            return f"{n} configs: tuned per key through the autotune table's results (prewarm tune)"
        return (f"not pinned: the node benchmarks its {n} configs at the first call of each tuning key, in every "
                f"process (this Triton keeps no autotune results): pin it ([[pinned]] in the manifest's autotune "
                f"table)")

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "label": self.label, "configs": len(self.configs),
                "pinned": self.pin.describe() if self.pin else None, "source": self.pin.source if self.pin else None,
                "candidate": self.candidate, "keeps_results": self.keeps}  # fmt: skip


def autotuned_kernels(requests: list[Request], pins: dict[str, PinnedRow]) -> list[AutotunedKernel]:
    """Every autotuned kernel the requests call, once, in plan order, with its pin (checked: ManifestError where
    it does not fit the kernel)."""
    found: dict[str, AutotunedKernel] = {}
    for r in requests:
        tuner = tritoncompat.find_autotuner(resolve(r.kernel))
        if tuner is None:
            continue
        ref = tritoncompat.kernel_ref(tuner)
        if ref not in found:
            pin = pins.get(ref)
            if pin is not None:
                pinned_config(tuner, pin)
            found[ref] = AutotunedKernel(ref, r.label, list(tuner.configs), pin, tritoncompat.can_keep_results(tuner))
    return list(found.values())


def measured(tunings: list[PlannedTuning], cache_dir: str | os.PathLike,
             device: str) -> tuple[list[TunedRow], list[TunedResult]]:
    """The table rows of the results Triton's Autotuner kept in ``cache_dir`` for the planned keys, and the keys it
    kept none for (a result over other configs than the ones planned counts as none)."""
    rows, missing = [], []
    for t in tunings:
        timings = {} if t.problem else kept_timings(cache_dir, t)
        if timings and set(timings) == set(t.config_names):
            rows.append(TunedRow(device, t.kernel, t.tuning_key, timings, t.label))
        else:
            why = t.problem or ("no provider call made this key on the device (function entries and recordings are "
                                "not run: a provider call with this key covers it)")
            missing.append(TunedResult(t, "absent", why))
    return rows, missing
