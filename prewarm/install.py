"""Install a bundle into a node's Triton cache dir: verified, atomic, locked, idempotent, merging.

Order of work: read the index (and check its signature when keys are given or one is required) -> check the
bundle's fingerprint against this node (the one place that judges the node: ``check_node``) -> take
``<cache>/.prewarm/install.lock`` -> skip entries already present (right file names and sizes) -> fetch the
other objects in parallel, check them (sha256 of the object, bounded decompression, tar members, every file's
sha256), write each into ``<cache>/.prewarm/staging-*/<KEY>`` with group files pointing at the final location,
fsync, rename the key dir into place -> write the receipt ``<cache>/.prewarm/receipts/<index sha256>.json``
last. A key dir is therefore either absent or complete: a crash leaves every previous entry intact and a re-run
finishes the job. Entries from other sources are never touched. Nothing from the bundle is executed.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import filelock

from . import fingerprint, signing
from .bundle import INDEX, META_DIR, OBJECTS, SIGNATURE, Entry, Index, is_group, open_object, parse_index, write_entry
from .errors import EnvironmentProblem, FingerprintMismatch, IntegrityError, StoreError
from .store import Store, default_store_root, join, open_store, retry

RECEIPTS = "receipts"
_ENV_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS}


def default_cache_dir() -> Path:
    """Where Triton itself looks: TRITON_CACHE_DIR, else ~/.triton/cache."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def resolve_source(source: str) -> str:
    """A URL, a local bundle dir, or a bare bundle name in the default store."""
    if "://" in source or Path(source).exists() or "/" in source:
        return source
    return join(default_store_root(), source)


@dataclass
class Bundle:
    """An index read from a store, its signature checked."""

    store: Store
    index: Index
    index_bytes: bytes
    signed_by: str | None


def read_bundle(
    source: str,
    *,
    trusted_keys: list[str] = (),
    require_signature: bool = False,
    storage_options: dict | None = None,
) -> Bundle:
    url = resolve_source(source)
    store = open_store(url, storage_options)
    where = join(url, INDEX)
    try:
        data = retry(lambda: store.read(INDEX), where)
    except FileNotFoundError:
        raise StoreError(f"{where}: no bundle index here (push one with `prewarm push`)") from None
    signed_by = None
    if trusted_keys or require_signature:
        sig = retry(lambda: store.read_optional(SIGNATURE), join(url, SIGNATURE))
        signed_by = signing.verify(data, sig, list(trusted_keys), where)
    return Bundle(store, parse_index(data, where), data, signed_by)


def node_fingerprint(built: dict[str, str]) -> dict[str, str]:
    """This node's factors for the bundle's backend. The arch is detected, not copied from the bundle: a node
    without a visible device reports it unknown (not compared); a node with another GPU is a mismatch."""
    return fingerprint.current(built.get("target.backend"))


def check_node(index: Index, node: dict[str, str], cache_dir: Path, allow_mismatch: bool) -> list[fingerprint.Mismatch]:
    """Compare the bundle's fingerprint with this node's; refuse on blocking factors unless allowed."""
    mismatches = fingerprint.compare(index.fingerprint, node)
    blocking = [m for m in mismatches if m.blocking]
    if blocking and not allow_mismatch:
        lines = "\n  ".join(str(m) for m in blocking)
        raise FingerprintMismatch(
            f"bundle was built for another toolchain than this node's ({len(blocking)} factor(s)); "
            f"refusing to install into {cache_dir}:\n  {lines}\n(--allow-fingerprint-mismatch overrides)"
        )
    return mismatches


@dataclass
class InstallResult:
    cache_dir: Path
    index_digest: str
    entries: int
    installed: int = 0  # unpacked by this run
    present: int = 0  # already there and intact
    replaced: int = 0  # there but incomplete or different: replaced by the bundle's
    bytes_fetched: int = 0
    noop: bool = False
    signed_by: str | None = None
    mismatches: list[fingerprint.Mismatch] = field(default_factory=list)  # overridden or informational
    seconds: float = 0.0


def entry_present(cache_dir: Path, entry: Entry) -> bool:
    """Cheap check (stat only): every listed file exists with its size (group files: exists; they are rewritten)."""
    base = f"{cache_dir}/{entry.key}/"
    for f in entry.files:
        try:
            size = os.stat(base + f.path).st_size
        except OSError:
            return False
        if size != f.size and not is_group(f.path):
            return False
    return True


def receipt_path(cache_dir: Path, index_digest: str) -> Path:
    return cache_dir / META_DIR / RECEIPTS / f"{index_digest}.json"


def read_receipts(cache_dir: Path) -> list[dict]:
    out = []
    for p in sorted((cache_dir / META_DIR / RECEIPTS).glob("*.json")):
        try:
            out.append(json.loads(p.read_bytes()))
        except (OSError, ValueError):
            continue  # a receipt is only ever replaced atomically; an unreadable one is not ours
    return out


def _write_receipt(cache_dir: Path, bundle: Bundle, source: str) -> None:
    path = receipt_path(cache_dir, bundle.index.digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "index_digest": bundle.index.digest,
        "source": source,
        "signed_by": bundle.signed_by,
        "cache_dir": str(cache_dir),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "index": bundle.index_bytes.decode(),  # verbatim: its checksum and digest still hold
    }
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stage_entry(bundle: Bundle, entry: Entry, cache_dir: Path, staging: Path) -> int:
    """Fetch and check one object, write its entry under ``staging``; returns the object's size."""
    name = f"{OBJECTS}/{entry.object}"
    where = join(bundle.store.url, name)
    try:
        obj = retry(lambda: bundle.store.read(name), where)
    except FileNotFoundError:
        raise IntegrityError(f"{where}: object of entry {entry.key} is missing from the bundle") from None
    files = open_object(obj, entry, where)
    write_entry(files, str(staging / entry.key), str(cache_dir / entry.key))
    return len(obj)


def _place_entry(key: str, cache_dir: Path, staging: Path) -> bool:
    """Rename a staged entry into place; returns whether it replaced an existing (incomplete or other) dir."""
    final = cache_dir / key
    try:
        os.rename(staging / key, final)
        return False
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    os.rename(final, staging / f"old-{key}")  # a key dir that did not match the bundle: set aside, then replaced
    os.rename(staging / key, final)
    return True


def install(
    source: str,
    cache_dir: str | os.PathLike | None = None,
    *,
    trusted_keys: list[str] = (),
    require_signature: bool = False,
    allow_fingerprint_mismatch: bool = False,
    storage_options: dict | None = None,
    workers: int | None = None,
    lock_timeout: float = 600,
    durable: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> InstallResult:
    """Install ``source`` (a bundle dir or store URL) into ``cache_dir``: every entry checked and staged first, then
    one rename per entry, then the receipt. ``progress(entries staged, entries to stage)`` as staging goes."""
    t0 = time.monotonic()
    cache_dir = Path(os.path.abspath(cache_dir or default_cache_dir()))
    bundle = read_bundle(
        source, trusted_keys=trusted_keys, require_signature=require_signature, storage_options=storage_options
    )
    index = bundle.index
    res = InstallResult(cache_dir, index.digest, len(index.entries), signed_by=bundle.signed_by)
    node = node_fingerprint(index.fingerprint)
    res.mismatches = check_node(index, node, cache_dir, allow_fingerprint_mismatch)
    meta = cache_dir / META_DIR
    try:
        meta.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(meta / "install.lock"), timeout=lock_timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise EnvironmentProblem(
                f"{meta / 'install.lock'}: another install held the lock for over {lock_timeout:.0f} s"
            ) from None
        try:
            # more threads than cores only thrash the GIL (tar parsing is Python); 8 hide a remote store's latency
            workers = workers or min(8, max(2, os.cpu_count() or 2))
            # One cache dir, one Ascend toolchain: Triton's key cannot tell them apart (no-op on CUDA).
            fingerprint.claim_cache_dir(cache_dir, node)
            _install_locked(bundle, source, cache_dir, res, workers, durable, progress)
        finally:
            lock.release()
    except OSError as e:
        if e.errno in _ENV_ERRNOS:
            raise EnvironmentProblem(f"{e.filename or cache_dir}: {e.strerror} (installing into {cache_dir})") from None
        raise
    res.seconds = time.monotonic() - t0
    return res


def _install_locked(bundle: Bundle, source: str, cache_dir: Path, res: InstallResult, workers: int, durable: bool,
                    progress: Callable[[int, int], None] | None):
    meta = cache_dir / META_DIR
    for old in meta.glob("staging-*"):  # left by a killed install; only the lock holder stages
        shutil.rmtree(old, ignore_errors=True)
    todo = [e for e in bundle.index.entries if not entry_present(cache_dir, e)]
    res.present = res.entries - len(todo)
    have_receipt = receipt_path(cache_dir, res.index_digest).exists()
    if not todo and have_receipt:
        res.noop = True
        return
    staging = meta / f"staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        # phase 1: every object fetched and checked, every entry staged; a bad bundle adds nothing to the cache
        with cf.ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(_stage_entry, bundle, e, cache_dir, staging) for e in todo]
            try:
                if progress:
                    progress(0, len(todo))
                for done, f in enumerate(cf.as_completed(futures), 1):
                    res.bytes_fetched += f.result()
                    if progress:
                        progress(done, len(todo))
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        if durable:
            os.sync()  # one flush of every staged file: far cheaper than an fsync per file, same guarantee
        # phase 2: one rename per entry (a key dir is either absent or complete), then the receipt
        for e in todo:
            res.replaced += _place_entry(e.key, cache_dir, staging)
            res.installed += 1
        if durable:
            _fsync_dir(cache_dir)
        _write_receipt(cache_dir, bundle, source)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
