"""Check a cache dir against what was installed into it (its receipts) or against a bundle.

Integrity: every listed file is hashed (group files in their relative form, since install rewrote them to
absolute paths; the entries spread over the cores by forked processes, prewarm.workers); files that differ (or are links, FIFOs, dirs) are *modified*, absent ones *missing*, anything
inside a listed entry that the index does not name (stray files, links, Triton's ``tmp.pid_*`` leftovers)
*unexpected*. Any group file in the cache (listed entry or not) whose children are not files of its own entry
points *outside*: Triton would read another dir's files or drop them and recompile. Where bundles share a key the
latest receipt (by sequence number) says what is installed. Key dirs no receipt names (compiled on the node) are
counted, never failed: install merges. Fails closed: an unreadable receipt is an IntegrityError naming it; a dir
with no receipt and no ``--bundle`` has unknown integrity (IntegrityError), except a build's own output dir (its
build info says so: only its group files are checked; will-hit does the rest).
Compatibility: each fingerprint factor of the bundle(s) against this node's own, mismatches explained.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import fingerprint
from . import workers as workers_
from .bundle import Entry, is_runtime_module
from .cachedir import CacheDir, Receipt, latest_owners
from .errors import FingerprintMismatch, IntegrityError
from .install import default_cache_dir, kept_as_built, node_fingerprint, read_bundle

_OTHER = "other"  # a key dir no receipt names: counted, only its group files judged


@dataclass
class _Check:
    """What verify's workers read (inherited through fork)."""

    cache: CacheDir
    tasks: list[tuple[str, Entry | None | str]]
    owners: dict[str, Receipt]


def _check_range(start: int, stop: int) -> list[tuple]:
    job: _Check = workers_.shared()
    return [_check(job, *job.tasks[i]) for i in range(start, stop)]


def _check(job: _Check, key: str, entry: Entry | None | str) -> tuple:
    if entry == _OTHER:  # counted, not judged: only a group pointing elsewhere makes Triton read another dir
        return 0, [], [], [], job.cache.entry_state(key).outside, 0, False
    owner = job.owners.get(key)
    files = entry.files if entry is not None else owner.files(key)
    c = job.cache.entry_state(key, files)
    if not c.intact and is_runtime_module(files):
        recorded = files if entry is None else owner.files(key) if owner is not None else None
        if kept_as_built(files, c, recorded):
            c.modified = []  # install keeps such a module as built on the node: verify agrees with it
    return len(files), c.modified, c.missing, c.unexpected, c.outside, c.hashed, c.intact


@dataclass
class FactorRow:
    factor: str
    bundle: str
    node: str
    status: str  # "ok" | "mismatch" (blocking) | "differs" (informational) | "unchecked" (unknown on a side)
    why: str = ""


@dataclass
class VerifyReport:
    cache_dir: str
    against: list[str]  # receipt files or the bundle URL
    entries: int = 0
    entries_ok: int = 0
    files: int = 0
    bytes_hashed: int = 0
    modified: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    groups_outside: list[str] = field(default_factory=list)
    other_entries: int = 0
    factors: list[FactorRow] = field(default_factory=list)

    @property
    def integrity_ok(self) -> bool:
        return not (self.modified or self.missing or self.unexpected or self.groups_outside)

    @property
    def compatible(self) -> bool:
        return all(f.status != "mismatch" for f in self.factors)

    @property
    def ok(self) -> bool:
        return self.integrity_ok and self.compatible

    @property
    def exit_code(self) -> int:
        if not self.integrity_ok:
            return IntegrityError.exit_code
        return 0 if self.compatible else FingerprintMismatch.exit_code

    def to_json(self) -> dict:
        doc = asdict(self)
        doc.update(ok=self.ok, integrity_ok=self.integrity_ok, compatible=self.compatible, exit_code=self.exit_code)
        return doc


def compare_factors(built: dict[str, str], node: dict[str, str] | None = None) -> list[FactorRow]:
    node = node or node_fingerprint()
    diffs = {m.factor: m for m in fingerprint.compare(built, node)}
    rows = []
    for factor in sorted(set(built) | set(node)):
        b, n = built.get(factor, fingerprint.UNKNOWN), node.get(factor, fingerprint.UNKNOWN)
        if factor in diffs:
            m = diffs[factor]
            rows.append(FactorRow(factor, m.built, m.node, "mismatch" if m.blocking else "differs", m.why))
        elif fingerprint.UNKNOWN in (b, n):
            rows.append(FactorRow(factor, b, n, "unchecked", "unknown on one side: cannot be compared"))
        else:
            rows.append(FactorRow(factor, b, n, "ok"))
    return rows


def verify(
    cache_dir: str | os.PathLike | None = None,
    *,
    bundle: str | None = None,
    trusted_keys: list[str] = (),
    require_signature: bool = False,
    storage_options: dict | None = None,
    check_fingerprint: bool = True,
    workers: int | None = None,
) -> VerifyReport:
    """Integrity of ``cache_dir`` against its install receipts (or ``bundle``) and compatibility with this node."""
    cache_dir = Path(os.path.abspath(cache_dir or default_cache_dir()))
    cache = CacheDir(cache_dir)
    if not cache_dir.is_dir():
        raise IntegrityError(f"{cache_dir}: cache dir does not exist or is not a directory")
    if bundle:
        b = read_bundle(
            bundle, trusted_keys=trusted_keys, require_signature=require_signature, storage_options=storage_options
        )
        fingerprints, against = [b.index.fingerprint], [bundle]
        owners = latest_owners(cache.receipts(strict=False))  # runtime-built modules kept by install
        checks = [(e.key, e) for e in b.index.entries]
    else:
        receipts = cache.receipts()
        fingerprints = [r.fingerprint for r in receipts]
        against = [f"receipt {r.path.stem[:16]}... (install #{r.seq})" for r in receipts]
        owners = latest_owners(receipts)
        checks = [(key, None) for key in owners]
        if not receipts:
            if not cache.read_build_info():
                raise IntegrityError(
                    f"{cache_dir}: integrity unknown: no install receipt in {cache.receipts_dir} (and no "
                    f"{cache.build_info.name}: not a build's output dir); give the bundle it came from with --bundle"
                )
            against = [f"{cache.build_info.name}: a build's output, no bundle installed (group files checked)"]
    if not bundle:
        for r in {id(r): r for r in owners.values()}.values():
            r.read_index()  # once, here, before the workers fork
    report = VerifyReport(str(cache_dir), against, entries=len(checks))
    checked = {key for key, _ in checks}
    others = [key for key in cache.entries()[0] if key not in checked]
    report.other_entries = len(others)
    # every file hashed, spread over the cores by processes (threads share one core for the per-file Python)
    tasks = checks + [(key, _OTHER) for key in others]
    processes = len(tasks) >= 64 and workers != 1 and workers_.can_fork()
    n = workers or workers_.cores()
    state = _Check(cache, tasks, owners)
    step = max(1, min(256, len(tasks) // (n * 16)))
    for chunk in workers_.run(_check_range, workers_.ranges(len(tasks), step), state, processes=processes,
                              workers=n if processes else 1):
        for key_files, modified, missing, unexpected, outside, hashed, intact in chunk:
            report.modified += modified
            report.missing += missing
            report.unexpected += unexpected
            report.groups_outside += outside
            report.bytes_hashed += hashed
            report.files += key_files
            report.entries_ok += intact
    if check_fingerprint:
        seen: list[dict] = []
        node = node_fingerprint(cache_dir)
        for fp in fingerprints:
            if fp not in seen:
                seen.append(fp)
                report.factors += compare_factors(fp, node)
        # A dir filled under another Ascend toolchain would be reused silently (not in Triton's key).
        for m in cache.toolchain_conflicts(node):
            report.factors.append(FactorRow(m.factor, m.built, m.node, "mismatch", m.why))
    return report

