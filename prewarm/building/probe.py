"""The probe: where would Triton look a planned compile up, and is it there? Computed without compiling.

Each planned compile is replayed through the real JIT path (``JITFunction.preload``) with a cache manager whose
``get_group`` raises: Triton's ``compile()`` computes the key exactly as at runtime (this process's triton,
Python ABI, env vars, the kernel's source and line number) and asks for ``__grp__<name>.json`` under the key
dir; the probe stops it right there and the entry is inspected as the runtime's ``get_group`` needs it: the group
file lists the kernel, every child file is present in the entry's own dir (``CacheDir.entry_state``). Build skips
what hits; will-hit reports it; each backend probes its C modules through the same manager (prewarm.building.backends).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from triton.runtime.cache import FileCacheManager

from . import tritoncompat
from ..shipping.cachedir import CacheDir
from ..node.explain import Explanation, explain_miss
from ..planning.plan import Compile, resolve


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


class RecordingCacheManager(ProbeCacheManager):
    """Records each file lookup, (key, file, present), in ``seen``; ``answer(filename, path, present)`` (set by the
    backend that probes its runtime modules) gives the path to return, or None: stop there with Probe."""

    seen: list[tuple[str, str, bool]] = []  # since the last clear

    @staticmethod
    def answer(filename: str, path: str, present: bool) -> str | None:
        return None

    def get_file(self, filename):
        path = os.path.join(self.cache_dir, filename)
        present = os.path.isfile(path)
        RecordingCacheManager.seen.append((self.key, filename, present))
        found = self.answer(filename, path, present)
        if found is None:
            raise Probe(self.key, self.cache_dir, filename)
        return found


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
class ModuleResult:
    """A C module the runtime builds at first launch: a kernel signature's launcher, or cuda_utils (CUDA; npu_utils
    and the precompiled header on Ascend)."""

    name: str  # "__triton_launcher" | "cuda_utils" | "launcher" | "npu_utils" | "precompiled.h"
    key: str
    present: bool
    kernels: int  # planned compiles that launch through it (0 for cuda_utils)
    detail: str = ""  # how it was keyed, or why this node's key is not in the cache, where that needs saying

    def to_json(self) -> dict:
        return {"name": self.name, "key": self.key, "present": self.present, "kernels": self.kernels,
                "detail": self.detail}


def found(cache_dir: str, key: str, filename: str) -> tuple[bool, str]:
    """(hit, why) for one key dir as Triton's FileCacheManager.get_group + compile() would see it."""
    group = f"__grp__{filename}"
    state = CacheDir(cache_dir).entry_state(key)
    if group not in state.groups:
        return False, f"not in the cache (no {key}/{group}): the node would compile it"
    if state.groups[group] is None:
        return False, f"{key}/{group} is unreadable: the node would compile it"
    if filename not in state.groups[group]:
        return False, f"{key}/{group} lists no {filename}: the node would compile it"
    if state.outside:
        return False, f"group file points outside its entry ({state.outside[0]}): not relocated for this location"
    if state.missing:
        missing = ", ".join(m.removeprefix(f"{key}/") for m in state.missing)
        return False, f"entry {key} is incomplete (missing {missing}): the node would compile it"
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
    if not p.filename.endswith(".json"):  # e.g. cuda_utils.*.so: the driver started inside the probe (see cuda.start_driver)
        return RequestResult(c.label, c.kernel, None, False, f"cannot compute the key: Triton looked up {p.filename} "
                             f"(a runtime module, not this kernel) first: the target's driver was not started")
    hit, detail = found(cache_dir, p.key, p.filename)
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


def planned_keys(compiles: list[Compile]) -> dict[str, Compile]:
    """The cache key dir each compile is looked up under (Triton computes it; nothing is looked at on disk)."""
    keys = {}
    with tritoncompat.cache_scope(os.path.abspath(tritoncompat.cache_dir()), ProbeCacheManager):
        for c in compiles:
            p = lookup(resolve(c.kernel), c.specialization)
            if p is not None and not p.filename.endswith(".json"):
                raise RuntimeError(f"{c.label}: Triton looked up {p.filename} (a runtime module) before the kernel: "
                                   f"the target's driver was not started")
            if p is not None:
                keys.setdefault(p.key, c)
    return keys


class ReadOnlyCacheManager(FileCacheManager):
    """Loads what is in the cache; refuses to write (verify changes nothing)."""

    def put(self, data, filename, binary=True):
        raise RuntimeError(f"verify would have written {self.key}/{filename}")
