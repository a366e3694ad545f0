"""Will-hit: would this environment's Triton find every planned kernel in a cache dir? Computed without compiling.

Each planned compile is replayed through the real JIT path (``JITFunction.preload``) with a cache manager whose
``get_group`` raises: Triton's ``compile()`` computes the key exactly as at runtime (this process's triton,
Python ABI, env vars, the kernel's source and line number) and asks for ``__grp__<name>.json`` under the key
dir; the probe stops it right there and the entry is inspected (group file present, every child file present
and inside the cache dir, as the runtime's ``get_group`` needs it).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from triton.runtime.cache import FileCacheManager

from . import tritoncompat
from .manifest import load
from .plan import Compile, expand_all, plan, resolve
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


@dataclass
class RequestResult:
    label: str
    kernel: str  # "module:name"
    key: str | None  # the cache key dir Triton looks in (None when the key could not be computed)
    hit: bool
    detail: str

    def to_json(self) -> dict:
        return {"label": self.label, "kernel": self.kernel, "key": self.key, "hit": self.hit, "detail": self.detail}


@dataclass
class WillHitReport:
    manifest: str
    cache_dir: str
    target: str
    results: list[RequestResult] = field(default_factory=list)

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


def probe(c: Compile, cache_dir: str) -> RequestResult:
    """Hit or miss for one compile, under the active target and ``cache_dir`` (already in scope)."""
    try:
        tritoncompat.preload(resolve(c.kernel), c.specialization)
    except Probe as p:
        hit, detail = entry_state(cache_dir, p.key, p.filename)
        return RequestResult(c.label, c.kernel, p.key, hit, detail)
    except Exception as e:  # the key itself could not be computed: the runtime would fail the same way
        return RequestResult(c.label, c.kernel, None, False, f"cannot compute the key: {type(e).__name__}: {e}")
    return RequestResult(c.label, c.kernel, None, False, "Triton did not look this kernel up in the cache")


def probe_all(compiles: list[Compile], cache_dir: str) -> list[RequestResult]:
    with tritoncompat.cache_scope(os.path.abspath(cache_dir), ProbeCacheManager):
        return [probe(c, cache_dir) for c in compiles]


def check(manifest_path: str, cache_dir: str, mode: str = "auto") -> WillHitReport:
    """For every compile the manifest plans, would this environment's runtime find it in ``cache_dir``?"""
    manifest = load(manifest_path)
    target: Target = get_target(manifest.backend, manifest.arch, mode)
    target.activate()
    compiles = expand_all(plan(manifest).requests)
    report = WillHitReport(manifest.name, os.path.abspath(cache_dir), target.describe())
    report.results = probe_all(compiles, cache_dir)
    return report
