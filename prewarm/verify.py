"""Check a cache dir against what was installed into it (its receipts) or against a bundle.

Integrity: every listed file is hashed (group files in their relative form, since install rewrote them to
absolute paths); files that differ are *modified*, absent ones *missing*, files inside a listed entry that the
index does not name *unexpected*. Any group file in the cache (listed entry or not) whose children are not
files of its own entry points *outside*: Triton would read another dir's files or drop them and recompile.
Key dirs no receipt names (compiled on the node, other bundles) are counted, never failed: install merges.
Compatibility: each fingerprint factor of the bundle(s) against this node, mismatches explained.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import fingerprint
from .bundle import GROUP_PREFIX, META_DIR, Entry, is_group, list_entries, parse_index, relative_group
from .errors import FingerprintMismatch, IntegrityError
from .install import default_cache_dir, node_fingerprint, read_bundle, read_receipts

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


def _read(path: str) -> bytes | None:
    """Whole-file read: Triton cache files are small, and one read per file keeps per-file overhead low."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    try:
        with os.fdopen(fd, "rb", buffering=0) as f:
            return f.read()
    except IsADirectoryError:
        return b"\0(a directory)"


def _listing(base: str, prefix: str = "") -> list[str]:
    """Files under an entry dir, relative, skipping Triton's own in-flight ``tmp.pid_*`` dirs."""
    out = []
    try:
        it = list(os.scandir(base))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for d in it:
        if d.is_dir(follow_symlinks=False):
            if not d.name.startswith("tmp.pid_"):
                out += _listing(d.path, f"{prefix}{d.name}/")
        else:
            out.append(prefix + d.name)
    return out


def _check_entry(cache_dir: str, entry: Entry) -> tuple[list[str], list[str], list[str], list[str], int]:
    """(modified, missing, unexpected, groups outside, bytes hashed) for one listed entry."""
    base = f"{cache_dir}/{entry.key}/"
    modified, missing, outside, hashed = [], [], [], 0
    names = {f.path.rsplit("/", 1)[-1] for f in entry.files}
    for f in entry.files:
        rel = f"{entry.key}/{f.path}"
        data = _read(base + f.path)
        if data is None:
            missing.append(rel)
            continue
        if is_group(f.path):
            try:
                data, out = relative_group(data, entry.key, names, base + f.path, base.rstrip("/"))
            except IntegrityError:
                modified.append(rel)
                continue
            if out:  # reported as pointing outside, not also as modified
                outside += [f"{rel} -> {p}" for p in out]
                continue
        hashed += len(data)
        if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:  # GIL released: parallel
            modified.append(rel)
    listed = {f.path for f in entry.files}
    unexpected = sorted(f"{entry.key}/{n}" for n in _listing(base) if n not in listed)
    return modified, missing, unexpected, outside, hashed


def _foreign_groups_outside(entry_dir: Path) -> list[str]:
    """Children of an unlisted entry's group files that are not files of that entry."""
    out = []
    names = {p.name for p in entry_dir.iterdir()}
    for g in sorted(entry_dir.glob(f"{GROUP_PREFIX}*.json")):
        try:
            _, bad = relative_group(g.read_bytes(), entry_dir.name, names, str(g), str(entry_dir))
        except (IntegrityError, OSError):
            continue  # not a group file prewarm understands; Triton ignores invalid groups too
        out += [f"{entry_dir.name}/{g.name} -> {p}" for p in bad]
    return out


def compare_factors(built: dict[str, str]) -> list[FactorRow]:
    node = node_fingerprint(built)
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
    allow_no_reference: bool = False,
) -> VerifyReport:
    """Integrity of ``cache_dir`` against its install receipts (or ``bundle``) and compatibility with this node.

    ``allow_no_reference``: a dir that no bundle was installed into (a build's output) is not an error; its
    entries are then only checked for group files pointing outside (will-hit, when asked, does the rest).
    """
    cache_dir = Path(os.path.abspath(cache_dir or default_cache_dir()))
    if not cache_dir.is_dir():
        raise IntegrityError(f"{cache_dir}: cache dir does not exist")
    if bundle:
        b = read_bundle(
            bundle, trusted_keys=trusted_keys, require_signature=require_signature, storage_options=storage_options
        )
        indexes, against = [b.index], [bundle]
    else:
        receipts = sorted(read_receipts(cache_dir), key=lambda r: r.get("installed_at", ""))
        if not receipts and not allow_no_reference:
            raise IntegrityError(
                f"{cache_dir}: no install receipt in {cache_dir / META_DIR / 'receipts'} and no --bundle given: "
                "nothing to verify against"
            )
        indexes = [parse_index(str(r.get("index", "")).encode(), f"receipt {r.get('index_digest')}") for r in receipts]
        against = [f"receipt {r.get('index_digest')}" for r in receipts]
    entries: dict[str, Entry] = {}
    for idx in indexes:  # later installs win where two bundles carry the same key
        entries.update({e.key: e for e in idx.entries})
    report = VerifyReport(str(cache_dir), against, entries=len(entries))
    # hashlib releases the GIL, but where "cores" are hyperthreads or busy, threads slow hashing down (measured
    # on the 2-core CI box, 517 MB: 1 thread 1.60 s, 2 threads 1.75 s, 4 threads 2.44 s): half the cores, and
    # no pool at all for one
    workers = workers or max(1, (os.cpu_count() or 2) // 2)
    check = functools.partial(_check_entry, str(cache_dir))
    with cf.ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        results = pool.map(check, entries.values()) if pool else map(check, entries.values())
        for e, (mod, miss, unexp, out, hashed) in zip(entries.values(), results):
            report.modified += mod
            report.missing += miss
            report.unexpected += unexp
            report.groups_outside += out
            report.bytes_hashed += hashed
            report.files += len(e.files)
            report.entries_ok += not (mod or miss or unexp or out)
    others = [d for d in list_entries(cache_dir)[0] if d.name not in entries]
    report.other_entries = len(others)
    for d in others:
        report.groups_outside += _foreign_groups_outside(d)
    if check_fingerprint:
        seen: list[dict] = []
        for idx in indexes:
            if idx.fingerprint not in seen:
                seen.append(idx.fingerprint)
                report.factors += compare_factors(idx.fingerprint)
        # A dir filled under another Ascend toolchain would be reused silently (not in Triton's key).
        backends = {idx.fingerprint.get("target.backend") for idx in indexes} or {None}
        for backend in backends:
            node = fingerprint.current(backend)
            for m in fingerprint.cache_dir_toolchain_conflict(cache_dir, node):
                report.factors.append(FactorRow(m.factor, m.built, m.node, "mismatch", m.why))
    return report

