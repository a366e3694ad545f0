"""Explain a compile: the planned compile nearest to a runtime request, and exactly what differs between them.

A runtime request (a jit_cache_hook's specialization data, a ``prewarm record`` line, or a key dir the runtime's
own JIT wrote) is compared with every planned :class:`~prewarm.planning.plan.Compile` of the same kernel; the one with the
fewest differing fields is the nearest, and each differing field is one :class:`Difference`: an argument's dtype
(``*bf16`` vs ``*fp32``), its specialization class (== 1 / divisible by 16 / other), a constexpr value, a compile
option, an env var of Triton's key. The same comparison explains a planned compile that a cache lacks (verify's
MISS rows): there the cache's entries of that kernel are the candidates. Parsing is version-specific and lives in
:mod:`prewarm.building.tritoncompat`; this module only compares.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..building import tritoncompat
from ..shipping.cachedir import CacheDir
from ..errors import ManifestError
from ..planning.plan import Compile, load_record, parse_compile_data
from ..building.tritoncompat import Arg, Specialization

UNSET = "unset"
NOT_RECORDED = "not in the compiled signature: a constexpr or an int specialized to 1 / None (a key dir does not say)"


@dataclass(frozen=True)
class Difference:
    """One field in which a runtime request differs from the planned one."""

    kind: str  # "dtype" | "specialization" | "constexpr" | "argument" | "option" | "env" | "triton" | "key", and
    # for two keys' parts (prewarm.building.keys): "backend" | "source" | "line" | "global" | "call" | "request"
    name: str  # the argument, option or env var
    planned: str
    runtime: str
    sides: tuple[str, str] | None = None  # its own names of the two sides, where the explanation's do not fit

    def format(self, sides: tuple[str, str] = ("planned", "runtime")) -> str:
        sides = self.sides or sides
        if self.kind == "key":
            return (f"cache key: {sides[0]} {self.planned}, {sides[1]} {self.runtime} (the same in every field a key "
                    f"dir records: a constexpr value, the kernel's source or line, or the triton build differs)")
        what = {"dtype": "argument", "specialization": "argument", "constexpr": "constexpr", "argument": "argument",
                "option": "option", "env": "env var", "triton": "triton", "backend": "backend",
                "source": "kernel source", "line": "kernel line", "global": "global", "call": "called function",
                "request": "request"}[self.kind]  # fmt: skip
        return f"{what} {self.name}: {sides[0]} {self.planned}, {sides[1]} {self.runtime}"

    def __str__(self) -> str:
        return self.format()

    def to_json(self, sides: tuple[str, str] = ("planned", "runtime")) -> dict:
        sides = self.sides or sides
        return {"kind": self.kind, "name": self.name, sides[0]: self.planned, sides[1]: self.runtime}


@dataclass(frozen=True)
class CacheEntry:
    """A key dir of a cache, as a candidate when a planned compile is explained against what the cache holds."""

    key: str
    label: str  # the kernel's function name and the key dir
    kernel: str


@dataclass(frozen=True)
class Explanation:
    """A runtime request, its nearest planned compile (None: no planned compile of this kernel), the differences."""

    runtime: str  # the request's specialization data, or the key dir it was read from
    kernel: str  # the runtime request's kernel, as Triton names it
    nearest: Compile | CacheEntry | None
    differences: tuple[Difference, ...]
    note: str = ""  # what could not be compared (a key dir's unrecorded fields)
    sides: tuple[str, str] = ("planned", "runtime")  # verify's MISS rows compare the cache with the plan

    @property
    def planned(self) -> bool:
        """The request is planned exactly (as far as the runtime side is known)."""
        return self.nearest is not None and not self.differences

    def to_json(self) -> dict:
        nearest = None
        if isinstance(self.nearest, Compile):
            nearest = self.nearest.to_json()
        elif isinstance(self.nearest, CacheEntry):
            nearest = {"key": self.nearest.key, "label": self.nearest.label, "kernel": self.nearest.kernel}
        return {"kernel": self.kernel, "planned": self.planned, "nearest": nearest,
                "differences": [d.to_json(self.sides) for d in self.differences], "note": self.note}  # fmt: skip

    def summary(self) -> str:
        """One line: what a table cell or a log line shows."""
        if self.nearest is None:
            return f"no {'planned' if self.sides[0] == 'planned' else 'cached'} compile of {self.kernel}"
        if not self.differences:
            return f"planned: {self.nearest.label}" + (f" ({self.note})" if self.note else "")
        return f"nearest {self.nearest.label}: " + "; ".join(d.format(self.sides) for d in self.differences)

    def __str__(self) -> str:
        """The nearest's label first, then one line per difference."""
        if self.nearest is None or not self.differences:
            return self.summary() + (f"\n  ({self.note})" if self.note and self.nearest is None else "")
        lines = [f"nearest: {self.nearest.label}"] + [f"  {d.format(self.sides)}" for d in self.differences]
        return "\n".join(lines + ([f"  ({self.note})"] if self.note else []))


# --- comparing two requests ----------------------------------------------------------------------------------------


def _same_kernel(a: Specialization, b: Specialization) -> bool:
    if a.name == b.name:
        return True  # a key dir and 3.2 record the bare function name only
    return (not a.complete or not b.complete or "." not in a.name or "." not in b.name) and a.function == b.function


def _canonical(value: Any) -> Any:
    """Lists and tuples alike (JSON makes lists); library paths by file name (the key hashes their content)."""
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, str) and os.sep in value:
        return os.path.basename(value)
    return value


def _arg_difference(name: str, planned: Arg | None, runtime: Arg | None) -> Difference | None:
    if planned == runtime:
        return None
    if planned is None or runtime is None:
        have = planned or runtime
        return Difference("argument", name, "absent" if planned is None else have.describe(),
                          "absent" if runtime is None else have.describe())
    if planned.type == runtime.type == "constexpr":
        return Difference("constexpr", name, planned.describe(), runtime.describe())
    if planned.type != runtime.type and "constexpr" not in (planned.type, runtime.type):
        if planned.attrs == runtime.attrs:  # only the dtype differs: say just that
            return Difference("dtype", name, planned.type, runtime.type)
        return Difference("dtype", name, planned.describe(), runtime.describe())
    # one side compiled the value in (Triton specializes ints equal to 1, and None), or the class differs
    return Difference("specialization", name, _specialized(planned), _specialized(runtime))


def _specialized(a: Arg) -> str:
    return f"== {a.value!r} (compiled in)" if a.type == "constexpr" else a.describe()


def compare(runtime: Specialization, planned: Specialization, runtime_env: Mapping[str, str] | None = None,
            planned_env: Mapping[str, str] | None = None) -> list[Difference]:
    """Every field in which ``runtime`` differs from ``planned`` (same kernel). A side read from a key dir lacks
    constexprs: where the other side has a constexpr there, nothing is compared; where it has a runtime argument,
    the key dir's side says it was compiled in (specialized)."""
    out: list[Difference] = []
    names = list(planned.args) + [n for n in runtime.args if n not in planned.args]
    for n in names:
        p, r = planned.args.get(n), runtime.args.get(n)
        if p is None and not planned.complete or r is None and not runtime.complete:
            other = r if p is None else p
            if other.type != "constexpr":
                out.append(Difference("specialization", n, NOT_RECORDED if p is None else p.describe(),
                                      NOT_RECORDED if r is None else r.describe()))
            continue
        d = _arg_difference(n, p, r)
        if d is not None:
            out.append(d)
    for k in [k for k in planned.options if k in runtime.options]:
        if _canonical(planned.options[k]) != _canonical(runtime.options[k]):
            out.append(Difference("option", k, repr(planned.options[k]), repr(runtime.options[k])))
    if runtime_env is not None and planned_env is not None:
        for k in sorted(set(runtime_env) | set(planned_env)):
            if runtime_env.get(k) != planned_env.get(k):
                out.append(Difference("env", k, planned_env.get(k, UNSET), runtime_env.get(k, UNSET)))
    pv, rv = planned.context.get("triton_version"), runtime.context.get("triton_version")
    if pv and rv and pv != rv:
        out.append(Difference("triton", "version", pv, rv))
    return out


# --- explaining ------------------------------------------------------------------------------------------------------


def _nearest(runtime: Specialization, candidates: Iterable[tuple[Any, Specialization, Mapping | None]],
             runtime_env: Mapping | None) -> tuple[Any, list[Difference]]:
    best, best_diffs = None, []
    for obj, spec, env in candidates:
        if not _same_kernel(runtime, spec):
            continue
        diffs = compare(runtime, spec, runtime_env, env)
        if best is None or len(diffs) < len(best_diffs):
            best, best_diffs = obj, diffs
            if not diffs:
                break
    return best, best_diffs


def explain(runtime: str, planned: Iterable[Compile], *, kernel: str | None = None,
            runtime_env: Mapping[str, str] | None = None, planned_env: Mapping[str, str] | None = None) -> Explanation:
    """The planned compile nearest to the request ``runtime`` (specialization data of either triton version) and
    what differs. ``kernel``: its "module:qualname" where known (orders triton 3.2's parameters); the env vars of
    Triton's key are compared only when both sides' are given."""
    spec = parse_compile_data(runtime, kernel)
    candidates = ((c, c.parsed, planned_env) for c in planned)
    nearest, diffs = _nearest(spec, candidates, runtime_env)
    return Explanation(runtime, spec.name, nearest, tuple(diffs) if nearest is not None else ())


KEY_DIR_NOTE = "read from a key dir: constexpr values and arguments specialized to 1 / None are not recorded there"


def _unrecorded(planned_key: str, runtime_key: str) -> Difference:
    """Two requests equal in every field a key dir records, under different keys."""
    return Difference("key", "key", planned_key, runtime_key)


def explain_key_dir(path: str | os.PathLike, planned: Iterable[Compile],
                    planned_keys: Mapping[str, Compile]) -> Explanation | None:
    """A key dir the runtime compiled, explained against the plan (None: the dir holds no kernel). Planned exactly
    when its name is one of ``planned_keys`` (each planned compile's key, as Triton computes it here); otherwise the
    nearest planned compile by what the dir records. Its env vars are compared with this process's: the plan is
    expanded here, under them."""
    spec = tritoncompat.read_key_dir(path)
    if spec is None:
        return None
    key = Path(path).name
    if key in planned_keys:
        return Explanation(str(path), spec.name, planned_keys[key], ())
    candidates = ((c, c.parsed, tritoncompat.cache_invalidating_env_vars()) for c in planned)
    nearest, diffs = _nearest(spec, candidates, spec.context.get("env"))
    if nearest is not None and not diffs:
        diffs = [_unrecorded(next((k for k, c in planned_keys.items() if c is nearest), "?"), key)]
    return Explanation(str(path), spec.name, nearest, tuple(diffs) if nearest is not None else (), note=KEY_DIR_NOTE)


_MISS_SIDES = ("cache", "planned")  # the planned compile is the request here; the cache entry is what it is held to


def explain_miss(c: Compile, cache_dir: str | os.PathLike, key: str,
                 sides: tuple[str, str] = _MISS_SIDES) -> Explanation:
    """Why a planned compile (looked up under ``key``) would miss in ``cache_dir``: the cache's nearest entry of that
    kernel and what differs (this process's env vars against those the entry was compiled under, too). No entry of
    the kernel: nearest None. ``sides`` names the two sides in the text (the guard: the cache and this process)."""
    spec = c.parsed
    entries = ((CacheEntry(k, f"{s.function} in {k}", s.name), s, s.context.get("env"))
               for k, s in _cache_entries(os.path.realpath(cache_dir)))
    nearest, diffs = _nearest(spec, entries, tritoncompat.cache_invalidating_env_vars())
    if nearest is None:
        return Explanation(c.specialization, spec.name, None, (), sides=sides,
                           note=f"the cache holds no compile of {spec.function}: it was not built into this bundle")
    # env vars are this process's, whichever side the planned compile stands for
    diffs = [dataclasses.replace(d, sides=("cache", "this process")) if d.kind == "env" else d for d in diffs]
    return Explanation(c.specialization, spec.name, nearest, tuple(diffs or [_unrecorded(nearest.key, key)]),
                       sides=sides)


@functools.lru_cache(maxsize=8)
def _cache_entries_cached(cache_dir: str, stamp: float) -> tuple[tuple[str, Specialization], ...]:
    out = []
    for key in CacheDir(cache_dir).entries()[0]:
        spec = tritoncompat.read_key_dir(Path(cache_dir, key))
        if spec is not None:
            out.append((key, spec))
    return tuple(out)


def _cache_entries(cache_dir: str) -> tuple[tuple[str, Specialization], ...]:
    """Every kernel entry of a cache dir, read once per state of the dir (its mtime)."""
    try:
        stamp = os.stat(cache_dir).st_mtime
    except OSError:
        return ()
    return _cache_entries_cached(cache_dir, stamp)


# --- a record file or a cache dir, against a plan ----------------------------------------------------------------------


def explain_path(path: str | os.PathLike, planned: list[Compile],
                 planned_keys: Mapping[str, Compile]) -> list[tuple[str, Explanation]]:
    """(label, explanation) for every runtime request in ``path``: a ``prewarm record`` / guard file (one request
    per distinct line), a key dir, or a cache dir (each key dir in it that holds a kernel)."""
    p = Path(path)
    if p.is_dir():
        dirs = [p] if tritoncompat.read_key_dir(p) is not None else sorted(d for d in p.iterdir() if d.is_dir())
        out = [(f"{e.kernel.rsplit('.', 1)[-1]} in {d.name}", e) for d in dirs
               if (e := explain_key_dir(d, planned, planned_keys)) is not None]
        if not out:
            raise ManifestError(f"{path}: no Triton kernel entry in it: expected a cache key dir (with the metadata "
                                f"<kernel>.json Triton writes) or a cache dir holding such key dirs")
        return out
    return [(r.label, explain(r.specialization, planned, kernel=r.kernel)) for r in load_record(str(p))]
