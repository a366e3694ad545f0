"""Install a bundle into a node's Triton cache dir: verified, atomic, locked, idempotent, merging.

Order of work (the paths are ``CacheDir``'s, prewarm.cachedir): read the index (and check its signature when keys
are given or one is required) -> check the bundle's fingerprint against this node (the one place that judges the
node: ``check_node``) -> take the dir's ``install_lock`` -> skip entries already present (by content: every file's
sha256 as the bundle lists it; for a C module the runtime builds non-reproducibly, a complete entry for the same
key, unless a receipt recorded other bytes for it; a file whose size, mtime, ctime and inode are still those this
bundle's last install recorded is not re-read, so a repeated install is a stat per file) -> stream the other objects
in parallel through one check-as-you-write pass (object sha256 and size, bounded decompression, tar members, every
file's sha256 and size) into ``new_staging()/<KEY>`` (inside the cache dir: the same filesystem) with group files
pointing at the final location, fsync, rename the key dir into place (a modified entry is replaced the same way) ->
write the ``receipt(<index sha256>)`` last, atomically, with the next sequence number and what is on disk where it
differs from the bundle. A key dir is therefore either absent or complete: a crash leaves every previous entry
intact and a re-run finishes the job. Entries from other sources are never touched. Nothing from the bundle is
executed.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import filelock

from . import fingerprint, signing
from .bundle import (INDEX, MAX_INDEX_BYTES, OBJECTS, SIGNATURE, Entry, FileRecord, Index, is_runtime_module,
                     parse_index, read_bounded, unpack_object)
from .cachedir import CacheDir, EntryState, fsync_dir, installed_files, stat_key
from .errors import EnvironmentProblem, FingerprintMismatch, IntegrityError, StoreError
from .stores import default_store_root, open_store
from .stores.base import Store, join, retry

MAX_SIGNATURE_BYTES = 64 << 10


def default_cache_dir() -> Path:
    """Where Triton itself looks: TRITON_CACHE_DIR, else ~/.triton/cache."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def resolve_source(source: str) -> str:
    """A URL, a local bundle dir, or a bare bundle name in the default store."""
    if "://" in source or Path(source).exists() or "/" in source:
        return source
    return join(default_store_root(), source)


@dataclass
class StoredBundle:
    """A bundle in a store, as install opens it: its index read and its signature checked (objects stay in the store)."""

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
) -> StoredBundle:
    url = resolve_source(source)
    store = open_store(url, storage_options)
    where = join(url, INDEX)
    try:
        data = _read_blob(store, INDEX, MAX_INDEX_BYTES)
    except FileNotFoundError:
        raise StoreError(f"{where}: no bundle index here (push one with `prewarm push`)") from None
    signed_by = None
    if trusted_keys or require_signature:
        try:
            sig = _read_blob(store, SIGNATURE, MAX_SIGNATURE_BYTES)
        except FileNotFoundError:
            sig = None
        signed_by = signing.verify(data, sig, list(trusted_keys), where)
    return StoredBundle(store, parse_index(data, where), data, signed_by)


def _read_blob(store: Store, name: str, limit: int) -> bytes:
    """A small blob (index, signature), read at most ``limit`` bytes; FileNotFoundError when absent."""
    where = join(store.url, name)

    def once() -> bytes:
        return read_bounded(_StoreStream(_open_blob(store, name, where)), limit, where)

    return retry(once, where)


def _open_blob(store: Store, name: str, where: str):
    try:
        return store.open(name)
    except (PermissionError, IsADirectoryError) as e:
        raise StoreError(f"{where}: cannot read ({e.strerror})") from None


class _StoreRead(Exception):
    """A read from a store failed mid-stream: retried like any transient store error (never a local write's)."""


class _StoreStream:
    """A store's stream whose read errors are told apart from the local filesystem's (which are not retried)."""

    def __init__(self, f):
        self.f = f

    def read(self, size: int = -1) -> bytes:
        try:
            return self.f.read(size)
        except Exception as e:
            raise _StoreRead(f"reading failed: {type(e).__name__}: {e}") from e

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def node_fingerprint() -> dict[str, str]:
    """This node's own factors: backend and arch detected here, never taken from a bundle (a CUDA node without a
    visible device reports its arch unknown: not compared; an Ascend node that cannot tell its SoC is refused; a node
    with another GPU or SoC is a mismatch)."""
    return fingerprint.current()


def check_node(index: Index, node: dict[str, str], cache_dir: Path, allow_mismatch: bool,
               allow_missing: bool = False) -> list[fingerprint.Mismatch]:
    """Compare the bundle's fingerprint with this node's; refuse on blocking factors unless allowed: values that
    differ (``allow_mismatch``), factors the bundle lacks, carries unknown or this node cannot know
    (``allow_missing``)."""
    mismatches = fingerprint.compare(index.fingerprint, node)
    refused = [m for m in mismatches if m.blocking and not (allow_missing if m.gap else allow_mismatch)]
    if refused:
        lines = "\n  ".join(str(m) for m in refused)
        flags = sorted({"--allow-missing-factors" if m.gap else "--allow-fingerprint-mismatch" for m in refused})
        raise FingerprintMismatch(
            f"bundle was built for another toolchain than this node's, or does not say which ({len(refused)} "
            f"factor(s)); refusing to install into {cache_dir}:\n  {lines}\n({' / '.join(flags)} overrides)"
        )
    return mismatches


@dataclass
class InstallResult:
    cache_dir: Path
    index_digest: str
    entries: int
    installed: int = 0  # unpacked by this run
    present: int = 0  # already there and intact (by content)
    replaced: int = 0  # there but incomplete, modified or different: replaced by the bundle's
    kept: int = 0  # of present: runtime-built C modules found complete with other bytes than the bundle's
    bytes_fetched: int = 0
    noop: bool = False
    signed_by: str | None = None
    mismatches: list[fingerprint.Mismatch] = field(default_factory=list)  # overridden or informational
    seconds: float = 0.0


# --- what is on disk ------------------------------------------------------------------------------------------


def kept_as_built(files: tuple[FileRecord, ...], c: EntryState, recorded: tuple[FileRecord, ...] | None) -> bool:
    """A C module the runtime builds (launcher, cuda_utils, npu_utils, precompiled header) differs per build: a
    complete one for the same key is as good as the bundle's, unless a receipt recorded other bytes for it."""
    complete = not (c.missing or c.unexpected or c.outside) and len(c.on_disk) == len(files)
    return complete and is_runtime_module(files) and set(recorded or c.on_disk) == set(c.on_disk)


def _write_receipt(cache: CacheDir, bundle: StoredBundle, source: str, seq: int,
                   kept: dict[str, tuple[FileRecord, ...]]) -> None:
    cache_dir = cache.root
    cache.write_receipt(bundle.index.digest, {
        "index_digest": bundle.index.digest,
        "seq": seq,
        "source": source,
        "signed_by": bundle.signed_by,
        "cache_dir": str(cache_dir),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # for people; order is seq's
        "kept": {k: [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in files]
                 for k, files in sorted(kept.items())},
        "stat": _stat_table(cache_dir, bundle.index, kept),
        "index": bundle.index_bytes.decode(),  # verbatim: its checksum and digest still hold
    })


def _stat_table(cache_dir: Path, index: Index, kept: dict[str, tuple[FileRecord, ...]]) -> dict:
    """{key: {path: stat key}} of every file as this install leaves it: the next install of the bundle re-reads only
    files whose stat key moved since (a same-size flip moves ctime)."""
    table: dict[str, dict[str, list[int]]] = {}
    for e in index.entries:
        for f in kept.get(e.key, e.files):
            try:
                table.setdefault(e.key, {})[f.path] = list(stat_key(os.lstat(cache_dir / e.key / f.path)))
            except OSError:
                continue  # gone already: hashed (and found missing) next time
    return table


# --- install --------------------------------------------------------------------------------------------------


def _stage_entry(bundle: StoredBundle, entry: Entry, cache_dir: Path, staging: Path) -> int:
    """Stream one object through its checks into ``staging/<key>``; returns the object's size. A store error
    mid-stream retries the entry from the start; a local write error is an EnvironmentProblem at once."""
    name = f"{OBJECTS}/{entry.object}"
    where = join(bundle.store.url, name)
    dest = staging / entry.key

    def once() -> int:
        shutil.rmtree(dest, ignore_errors=True)
        with _StoreStream(_open_blob(bundle.store, name, where)) as stream:
            try:
                return unpack_object(stream, entry, str(dest), str(cache_dir / entry.key), where)
            except OSError as e:  # store errors arrive as _StoreRead: this is the local filesystem
                raise EnvironmentProblem(f"{e.filename or dest}: {e.strerror} (staging entry {entry.key} of "
                                         f"{cache_dir})") from None

    try:
        return retry(once, where)
    except FileNotFoundError:
        raise IntegrityError(f"{where}: object of entry {entry.key} is missing from the bundle") from None


def _place_entry(key: str, cache_dir: Path, staging: Path) -> bool:
    """Rename a staged entry into place; returns whether it replaced an existing (incomplete or other) dir."""
    final = cache_dir / key
    try:
        os.rename(staging / key, final)
        return False
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
    os.rename(final, staging / f"old-{key}")  # what did not match the bundle: set aside, then replaced
    os.rename(staging / key, final)
    return True


def install(
    source: str,
    cache_dir: str | os.PathLike | None = None,
    *,
    trusted_keys: list[str] = (),
    require_signature: bool = False,
    allow_fingerprint_mismatch: bool = False,
    allow_missing_factors: bool = False,
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
    cache = CacheDir(cache_dir)
    for d in (cache_dir, cache.meta):
        if os.path.lexists(d) and not d.is_dir():
            raise EnvironmentProblem(f"{d}: exists and is not a directory (installing into {cache_dir})")
    bundle = read_bundle(
        source, trusted_keys=trusted_keys, require_signature=require_signature, storage_options=storage_options
    )
    index = bundle.index
    res = InstallResult(cache_dir, index.digest, len(index.entries), signed_by=bundle.signed_by)
    node = node_fingerprint()
    res.mismatches = check_node(index, node, cache_dir, allow_fingerprint_mismatch, allow_missing_factors)
    try:
        cache.meta.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(cache.install_lock), timeout=lock_timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise EnvironmentProblem(
                f"{cache.install_lock}: another install held the lock for over {lock_timeout:.0f} s"
            ) from None
        try:
            # more threads than cores only thrash the GIL (tar parsing is Python); 8 hide a remote store's latency
            workers = workers or min(8, max(2, os.cpu_count() or 2))
            # One cache dir, one Ascend toolchain: Triton's key cannot tell them apart (no-op on CUDA).
            cache.claim_toolchain(node)
            _install_locked(bundle, source, cache, res, workers, durable, progress)
        finally:
            lock.release()
    except OSError as e:  # store errors are StoreError / IntegrityError by now: this is the local machine
        raise EnvironmentProblem(f"{e.filename or cache_dir}: {e.strerror} (installing into {cache_dir})") from None
    res.seconds = time.monotonic() - t0
    return res


def _install_locked(bundle: StoredBundle, source: str, cache: CacheDir, res: InstallResult, workers: int, durable: bool,
                    progress: Callable[[int, int], None] | None):
    cache_dir = cache.root
    for old in cache.staging_dirs():  # left by a killed install; only the lock holder stages
        shutil.rmtree(old, ignore_errors=True)
    entries = bundle.index.entries
    receipts = cache.receipts(strict=False)
    recorded = installed_files(receipts)
    own = next((r for r in receipts if r.index.digest == res.index_digest), None)
    unchanged = own.unchanged() if own else {}
    with cf.ThreadPoolExecutor(workers) as pool:
        states = list(pool.map(lambda e: cache.entry_state(e.key, e.files, unchanged.get(e.key)), entries))
    todo, kept = [], {}
    for e, c in zip(entries, states):
        if c.intact:
            continue
        if kept_as_built(e.files, c, recorded.get(e.key)):
            kept[e.key] = tuple(c.on_disk)
            continue
        todo.append(e)
    res.present, res.kept = len(entries) - len(todo), len(kept)
    agrees = all(set(recorded.get(e.key, ())) == set(kept.get(e.key, e.files)) for e in entries)
    if not todo and own is not None and own.kept == kept and agrees:
        res.noop = True
        return
    seq = max((r.seq for r in receipts), default=0) + 1
    staging = cache.new_staging()
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
            fsync_dir(cache_dir)
        _write_receipt(cache, bundle, source, seq, kept)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
