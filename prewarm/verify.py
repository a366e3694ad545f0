"""Check a cache dir against what was installed into it (its receipts) or against a bundle.

Integrity: every listed file is hashed (group files in their relative form, since install rewrote them to
absolute paths); files that differ (or are links, FIFOs, dirs) are *modified*, absent ones *missing*, anything
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

import concurrent.futures as cf
import contextlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import fingerprint
from .cachedir import CacheDir, installed_files
from .errors import FingerprintMismatch, IntegrityError
from .install import default_cache_dir, kept_as_built, node_fingerprint, read_bundle

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


def compare_factors(built: dict[str, str]) -> list[FactorRow]:
    node = node_fingerprint()
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
        indexes, against = [b.index], [bundle]
        entries = {e.key: e.files for e in b.index.entries}
        recorded = installed_files(cache.receipts(strict=False))  # runtime-built modules kept by install
    else:
        receipts = cache.receipts()
        indexes = [r.index for r in receipts]
        against = [f"receipt {r.path.stem[:16]}... (install #{r.seq})" for r in receipts]
        entries = recorded = installed_files(receipts)
        if not receipts:
            if not cache.read_build_info():
                raise IntegrityError(
                    f"{cache_dir}: integrity unknown: no install receipt in {cache.receipts_dir} (and no "
                    f"{cache.build_info.name}: not a build's output dir); give the bundle it came from with --bundle"
                )
            against = [f"{cache.build_info.name}: a build's output, no bundle installed (group files checked)"]
    report = VerifyReport(str(cache_dir), against, entries=len(entries))
    # hashlib releases the GIL, but where "cores" are hyperthreads or busy, threads slow hashing down (measured
    # on the 2-core CI box, 517 MB: 1 thread 1.60 s, 2 threads 1.75 s, 4 threads 2.44 s): half the cores, and
    # no pool at all for one
    workers = workers or max(1, (os.cpu_count() or 2) // 2)
    check = cache.entry_state
    with cf.ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        results = pool.map(check, entries, entries.values()) if pool else map(check, entries, entries.values())
        for (key, files), c in zip(entries.items(), results):
            if not c.intact and kept_as_built(files, c, recorded.get(key)):
                c.modified = []  # install keeps such a module as built on the node: verify agrees with it
            report.modified += c.modified
            report.missing += c.missing
            report.unexpected += c.unexpected
            report.groups_outside += c.outside
            report.bytes_hashed += c.hashed
            report.files += len(files)
            report.entries_ok += c.intact
    others = [key for key in cache.entries()[0] if key not in entries]
    report.other_entries = len(others)
    for key in others:  # counted, not judged: only a group pointing elsewhere makes Triton read another dir
        report.groups_outside += cache.entry_state(key).outside
    if check_fingerprint:
        seen: list[dict] = []
        for idx in indexes:
            if idx.fingerprint not in seen:
                seen.append(idx.fingerprint)
                report.factors += compare_factors(idx.fingerprint)
        # A dir filled under another Ascend toolchain would be reused silently (not in Triton's key).
        for m in cache.toolchain_conflicts(node_fingerprint()):
            report.factors.append(FactorRow(m.factor, m.built, m.node, "mismatch", m.why))
    return report

