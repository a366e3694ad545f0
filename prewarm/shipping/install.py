"""Install a bundle into a node's cache dir: verified, atomic, locked, idempotent, merging. The dir is of the bundle's
layout (prewarm.shipping.layouts: Triton's cache, sglang's JIT cache, FlashInfer's AOT dir; by default the one its server
reads), and a dir of another layout is refused; the work is the same for each.

Order of work (the paths are ``CacheDir``'s, prewarm.shipping.cachedir): read the index bytes (and check their signature when
keys are given or one is required) -> check the bundle's fingerprint against this node (the one place that judges
the node: ``check_node``; the node's own factors are reused while nothing they are computed from changed:
prewarm.shipping.nodestamp) -> take the dir's ``install_lock`` -> decide what is to do:

- an install of this very index left a receipt, no later install claimed one of its keys with other files, and
  every entry's stamp (its dir's inode, mtime and ctime: ``cachedir.stamp``) is the recorded one: nothing to do,
  decided from the receipt and an lstat per entry (spread over the cores), without parsing the index or reading a
  file. A stamp sees files added, removed, renamed or replaced (Triton writes whole files and renames them in); not
  a file rewritten in place (``recheck`` reads every file; ``prewarm verify`` hashes every file);
- otherwise, entry by entry and in parallel: an entry whose stamp is as recorded is as that install left it; any
  other is checked by content, every file's sha256 as the bundle lists it (for a C module the runtime builds
  non-reproducibly, a complete entry for the same key, unless a receipt recorded other bytes for it); what is not
  there intact is fetched and checked as it is written, in one streaming pass per object (object sha256 and size,
  bounded decompression, tar members, every file's sha256 and size) into ``new_staging()/<KEY>`` (inside the cache
  dir: the same filesystem; a nested layout's key is a path there), group files pointing at the final location.

Every entry's file records are checked before or as it is staged, so a malformed index or object adds nothing to
the cache. Durability (``durable``), each flush where the order after a crash depends on it: the cache's filesystem
is flushed once (``syncfs``) after staging and before the first rename, so that a key dir never becomes visible with
data not on disk (a flusher writes back every quarter second while staging goes on, so that this flush finds little
left); the cache dir is fsynced after the renames, so that they are on disk before the receipt that describes them;
the receipt (the index beside it first, written while the entries stage, then the receipt itself, with the next
sequence number, each entry's stamp and what is on disk where it differs from the bundle) is written atomically and
fsynced. No fsync per file: one flush of the filesystem covers them all. A key dir is therefore either absent or
complete: a crash (SIGKILL anywhere) leaves every previous entry intact and a re-run finishes the job. A nested
layout's entry (sglang's leaf) is renamed into its parent dir, made first where missing (0755, none of them a link,
as sglang's own publication does), and the filesystem flushed after the renames instead of the one dir. Entries from
other sources are never touched. Nothing from the bundle is executed.

Work is spread over the cores (prewarm.building.workers): a local bundle's entries by forked processes (per-entry work is
Python; the member loop of most objects is C: bundle.unpack_object) in ranges that shrink towards the end (``_tasks``), a remote store's by threads (its latency
dominates). Memory is O(1) per entry: the index bytes, a few hundred bytes per entry, O(CHUNK) per worker; the
parent lets the index go once its workers have it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import layouts, nodestamp
from ..building import workers as workers_
from .bundle import (DIR_FLAGS, INDEX, MAX_INDEX_BYTES, OBJECTS, SIGNATURE, Entry, FileRecord, Index, index_layout,
    is_runtime_module, parse_index, read_bounded, unpack_object)
from .cachedir import CacheDir, EntryState, Receipt, fsync_dir, install_history, latest_owners, stamp, syncfs
from ..errors import EnvironmentProblem, FingerprintMismatch, IntegrityError, SignatureError, StoreError
from .stores.base import Store, join, retry


def default_cache_dir() -> Path:
    """Where Triton itself looks: TRITON_CACHE_DIR, else ~/.triton/cache."""
    return layouts.TRITON.node_dir()


def resolve_source(source: str) -> str:
    """A URL, a local bundle dir, or a bare bundle name in the default store."""
    if "://" in source or Path(source).exists() or "/" in source:
        return source
    from .stores import default_store_root

    return join(default_store_root(), source)


@dataclass
class StoredBundle:
    """A bundle in a store, as install opens it: its index bytes read and their signature checked (objects stay in
    the store). The index is parsed when first needed: a repeated install decides from its receipt."""

    store: Store
    index_bytes: bytes
    digest: str
    signed_by: str | None
    where: str
    signature: bytes | None = None  # checked (signed_by): kept beside the receipt as its proof
    layout: layouts.Layout = layouts.TRITON  # the index's (read from its fields after the entries)

    @property
    def index(self) -> Index:
        if (index := self.__dict__.get("_index")) is None:
            index = self.__dict__["_index"] = parse_index(self.index_bytes, self.where, check_files=False)
        return index

    def release(self) -> None:
        """Let the index and its bytes go (an install past its last use of them)."""
        self.__dict__.pop("_index", None)
        self.index_bytes = b""


def read_bundle(
    source: str,
    *,
    trusted_keys: list[str] = (),
    require_signature: bool = False,
    storage_options: dict | None = None,
) -> StoredBundle:
    url = resolve_source(source)
    store = _open_store(url, storage_options)
    where = join(url, INDEX)
    try:
        data = _read_blob(store, INDEX, MAX_INDEX_BYTES)
    except FileNotFoundError:
        raise StoreError(f"{where}: no bundle index here (push one with `prewarm push`)") from None
    signed_by = sig = None
    if trusted_keys or require_signature:
        from . import signing

        try:
            sig = _read_blob(store, SIGNATURE, signing.MAX_SIGNATURE_BYTES)
        except FileNotFoundError:
            sig = None
        except IntegrityError as e:  # larger than any signature, or not the blob the registry lists
            raise SignatureError(f"{e}: not a signature") from None
        signed_by = signing.verify(data, sig, list(trusted_keys), where)
    return StoredBundle(store, data, hashlib.sha256(data).hexdigest(), signed_by, where, sig,
                        layouts.get(index_layout(data, where)))


def _open_store(url: str, storage_options: dict | None) -> Store:
    if "://" not in url:  # a local dir: the stores package (and fsspec) only where a URL needs it
        from .stores.fs import LocalStore

        return LocalStore(url)
    from .stores import open_store

    return open_store(url, storage_options)


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

    def fileno(self) -> int:  # a local file: read_bounded reads it in one piece of its size
        return self.f.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def check_node(built: dict[str, str], node: dict[str, str], cache_dir: Path, allow_mismatch: bool,
               allow_missing: bool = False):
    """Compare the bundle's fingerprint (``built``) with this node's; refuse on blocking factors unless allowed:
    values that differ (``allow_mismatch``), factors the bundle lacks, carries unknown or this node cannot know
    (``allow_missing``)."""
    from ..node import fingerprint

    mismatches = fingerprint.compare(built, node)
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
    present: int = 0  # already there and intact (by stamp or by content)
    replaced: int = 0  # there but incomplete, modified or different: replaced by the bundle's
    kept: int = 0  # of present: runtime-built C modules found complete with other bytes than the bundle's
    bytes_fetched: int = 0
    noop: bool = False
    signed_by: str | None = None
    mismatches: list = field(default_factory=list)  # fingerprint.Mismatch: overridden or informational
    seconds: float = 0.0


# --- what is on disk ------------------------------------------------------------------------------------------


def kept_as_built(files: tuple[FileRecord, ...], c: EntryState, recorded: tuple[FileRecord, ...] | None) -> bool:
    """A C module the runtime builds (launcher, cuda_utils, npu_utils, precompiled header) differs per build: a
    complete one for the same key is as good as the bundle's, unless a receipt recorded other bytes for it."""
    complete = not (c.missing or c.unexpected or c.outside) and len(c.on_disk) == len(files)
    return complete and is_runtime_module(files) and set(recorded or c.on_disk) == set(c.on_disk)


# What settling one entry found (a worker's answer, a few hundred bytes): (outcome, stamp, kept files, bytes fetched,
# bytes of its files). A staged entry's stamp is taken once it is in place (a rename moves its dir's ctime).
PRESENT, KEPT, STAGED = 0, 1, 2


@dataclass
class _Job:
    """What every worker reads (``workers.shared()``: inherited through fork, never pickled)."""

    bundle: StoredBundle
    cache: CacheDir
    entries: tuple[Entry, ...]
    recorded: dict[str, list[str]]  # own receipt: key -> [object, stamp]; empty to check every entry by content
    own_kept: dict[str, tuple[FileRecord, ...]]
    owners: dict[str, Receipt]  # key -> latest receipt naming it
    staging: Path | None


def _stale(keys: list[str]) -> list[str]:
    """The keys whose entry is no longer as its receipt stamped it (a no-op's check: an lstat per entry)."""
    job: _Job = workers_.shared()
    root = str(job.cache.root)
    return [key for key in keys if stamp(f"{root}/{key}") != job.recorded[key][1] or not job.recorded[key][1]]


def _settle_range(start: int, stop: int) -> list[tuple]:
    job = workers_.shared()
    return [_settle(job, job.entries[i]) for i in range(start, stop)]


def _settle(job: _Job, e: Entry) -> tuple:
    """One entry: as its own receipt left it (by stamp), present by content, kept as built, or staged."""
    cache = job.cache
    recorded = job.recorded.get(e.key)
    before = stamp(f"{cache.root}/{e.key}")
    if recorded and recorded[1] and before == recorded[1] and recorded[0] == e.object:
        return (KEPT, before, job.own_kept[e.key], 0, 0) if e.key in job.own_kept else (PRESENT, before, None, 0, 0)
    files = e.files  # decoded and checked here: a malformed record stops the install before anything is placed
    size = sum(f.size for f in files)
    if before:  # there: by content (an absent entry is simply staged)
        c = cache.entry_state(e.key, files)
        if c.intact or is_runtime_module(files) and kept_as_built(files, c, _recorded(job, e.key)):
            after = cache.stamp(e.key)  # changed while it was read: not vouched for by this stamp
            return (PRESENT if c.intact else KEPT, before if before == after else "",
                    None if c.intact else tuple(c.on_disk), 0, size)
    return STAGED, "", None, _stage_entry(job.bundle, e, files, cache.root, job.staging), size


def _recorded(job: _Job, key: str) -> tuple[FileRecord, ...] | None:
    """What the latest install naming ``key`` recorded for it (its receipt's index is read here, where needed)."""
    owner = job.owners.get(key)
    return owner.files(key) if owner is not None else None


# --- install --------------------------------------------------------------------------------------------------


def _stage_entry(bundle: StoredBundle, entry: Entry, files: tuple[FileRecord, ...], cache_dir: Path,
                 staging: Path) -> int:
    """Stream one object through its checks into ``staging/<key>``; returns the object's size. A store error
    mid-stream retries the entry from the start; a local write error is an EnvironmentProblem at once."""
    name = f"{OBJECTS}/{entry.object}"
    where = join(bundle.store.url, name)
    dest = f"{staging}/{entry.key}"
    if bundle.layout.nested:  # staged at the same path as in the cache dir
        os.makedirs(os.path.dirname(dest), exist_ok=True)
    attempts = []

    def once() -> int:
        if attempts:  # a retry: what the failed attempt staged goes first
            shutil.rmtree(dest, ignore_errors=True)
        attempts.append(1)
        with _StoreStream(_open_blob(bundle.store, name, where)) as stream:
            try:
                return unpack_object(stream, entry, dest, f"{cache_dir}/{entry.key}", where, files,
                                     bundle.layout.groups)
            except OSError as e:  # store errors arrive as _StoreRead: this is the local filesystem
                raise EnvironmentProblem(f"{e.filename or dest}: {e.strerror} (staging entry {entry.key} of "
                                         f"{cache_dir})") from None

    try:
        return retry(once, where)
    except FileNotFoundError:
        raise IntegrityError(f"{where}: object of entry {entry.key} is missing from the bundle") from None


def _place_entries(keys: list[str], todo: list[int], cache_dir: Path, staging: Path, stamps: list[str]) -> int:
    """Rename each staged entry (``keys[i]`` for i in ``todo``) into place and take its stamp there into ``stamps[i]``
    (the rename moved its dir's ctime); returns how many replaced an existing (incomplete or other) dir. Both dirs
    are opened once: no path is walked per entry."""
    replaced = 0
    cache_fd = os.open(cache_dir, DIR_FLAGS)
    try:
        staging_fd = os.open(staging, DIR_FLAGS)
        try:
            for i in todo:
                try:
                    replaced += _place_entry(keys[i], cache_fd, staging_fd)
                except OSError as e:
                    raise OSError(e.errno, e.strerror, str(cache_dir / keys[i])) from None
                stamps[i] = stamp(keys[i], dir_fd=cache_fd)
        finally:
            os.close(staging_fd)
    finally:
        os.close(cache_fd)
    return replaced


def _place_entry(key: str, cache_fd: int, staging_fd: int) -> bool:
    """Rename a staged entry into place (a nested key: into its parent dir, made where missing); returns whether it
    replaced an existing (incomplete or other) dir."""
    parent, _, leaf = key.rpartition("/")
    dest_fd = _open_parent(cache_fd, parent) if parent else cache_fd
    try:
        try:
            os.rename(key, leaf, src_dir_fd=staging_fd, dst_dir_fd=dest_fd)
            return False
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
        aside = "old-" + key.replace("/", "%")  # no key holds a '%'
        os.rename(leaf, aside, src_dir_fd=dest_fd, dst_dir_fd=staging_fd)  # what did not match: set aside
        os.rename(key, leaf, src_dir_fd=staging_fd, dst_dir_fd=dest_fd)
        return True
    finally:
        if dest_fd != cache_fd:
            os.close(dest_fd)


def _open_parent(cache_fd: int, parent: str) -> int:
    """The dir ``parent`` below the cache dir, opened; each part made where missing (0755) and none followed as a
    link (ELOOP), so that an entry is never renamed through a link out of the cache dir."""
    fd = cache_fd
    try:
        for part in parent.split("/"):
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                below = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise OSError(e.errno, f"its parent {part!r} is a link or a file, never followed") from None
            if fd != cache_fd:
                os.close(fd)
            fd = below
        return fd
    except BaseException:
        if fd != cache_fd:
            os.close(fd)
        raise


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
    recheck: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> InstallResult:
    """Install ``source`` (a bundle dir or store URL) into ``cache_dir`` (default: the dir the server of the bundle's
    layout reads; layouts.NoNodeDir where none is named): every entry checked and staged first, then one rename per
    entry, then the receipt. ``recheck``: every entry checked by content, stamps or not (what a file rewritten in
    place needs). ``progress(entries settled, entries to settle)`` as the work goes."""
    t0 = time.monotonic()
    bundle = read_bundle(
        source, trusted_keys=trusted_keys, require_signature=require_signature, storage_options=storage_options
    )
    cache_dir = Path(os.path.abspath(cache_dir or bundle.layout.node_dir()))
    cache = CacheDir(cache_dir, bundle.layout)
    for d in (cache_dir, cache.meta):
        if os.path.lexists(d) and not d.is_dir():
            raise EnvironmentProblem(f"{d}: exists and is not a directory (installing into {cache_dir})")
    own = cache.receipt_of(bundle.digest)  # the index it names is this one, checked whole when installed
    built = own.fingerprint if own else bundle.index.fingerprint
    res = InstallResult(cache_dir, bundle.digest, len(own.entries) if own else len(bundle.index.entries),
                        signed_by=bundle.signed_by)
    node, record = nodestamp.node_factors(bundle.layout, cache.meta if cache.meta.is_dir() else None)
    res.mismatches = check_node(built, node, cache_dir, allow_fingerprint_mismatch, allow_missing_factors)
    try:
        cache.meta.mkdir(parents=True, exist_ok=True)
        if record is not None:
            nodestamp.remember(cache.meta, record)
        import filelock

        lock = filelock.FileLock(str(cache.install_lock), timeout=lock_timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise EnvironmentProblem(
                f"{cache.install_lock}: another install held the lock for over {lock_timeout:.0f} s"
            ) from None
        try:
            cache.claim_layout()  # one cache dir, one layout: its server reads no other
            # One cache dir, one Ascend toolchain: Triton's key cannot tell them apart (no-op on CUDA).
            cache.claim_toolchain(node)
            _install_locked(bundle, source, cache, res, workers, durable, recheck, progress)
        finally:
            lock.release()
    except OSError as e:  # store errors are StoreError / IntegrityError by now: this is the local machine
        raise EnvironmentProblem(f"{e.filename or cache_dir}: {e.strerror} (installing into {cache_dir})") from None
    res.seconds = time.monotonic() - t0
    return res


def _workers(workers: int | None, processes: bool) -> int:
    return workers or (workers_.cores() if processes else min(8, max(2, workers_.cores())))  # threads: a store's latency


def _install_locked(bundle: StoredBundle, source: str, cache: CacheDir, res: InstallResult, workers: int | None,
                    durable: bool, recheck: bool, progress: Callable[[int, int], None] | None):
    cache_dir = cache.root
    for old in cache.staging_dirs():  # left by a killed install; only the lock holder stages
        shutil.rmtree(old, ignore_errors=True)
    receipts = cache.receipts(strict=False)
    own = next((r for r in receipts if r.digest == res.index_digest), None)
    later = [r for r in receipts if own is not None and r.seq > own.seq]
    local = type(bundle.store).__name__ == "LocalStore"
    recorded = own.entries if own is not None and not recheck else {}
    if recorded and _latest_for_its_keys(own, later):
        # nothing to do if every entry is as stamped: an lstat per entry, no file read, no index parsed
        keys = list(recorded)
        processes = local and len(keys) >= workers_.PROCESSES_FROM and workers_.can_fork()
        job = _Job(bundle, cache, (), recorded, own.kept, {}, None)
        if not any(workers_.run(_stale, [(keys[a:b],) for a, b in workers_.ranges(len(keys), 4096)], job,
                                processes=processes, workers=_workers(workers, processes))):
            res.present, res.kept, res.noop = len(keys), len(own.kept), True
            cache.keep_signature(bundle.digest, bundle.signature, durable=durable)  # installed before without --trust
            return
    entries = bundle.index.entries
    staging = cache.new_staging()
    try:
        # phase 1: every entry settled (its records checked, present by stamp or content, else fetched, checked and
        # staged); a bad bundle adds nothing to the cache
        job = _Job(bundle, cache, entries, recorded, own.kept if own else {}, latest_owners(receipts), staging)
        processes = local and len(entries) >= workers_.PROCESSES_FROM and workers_.can_fork()
        n = _workers(workers, processes)
        tasks = _tasks(len(entries), n) if processes else workers_.ranges(len(entries), 1)
        done = [0]

        def count(chunk: list) -> None:
            done[0] += len(chunk)
            if progress:
                progress(done[0], len(keys))

        keys = [e.key for e in entries]
        objects = [e.object for e in entries]
        head = {"fingerprint": bundle.index.fingerprint, "manifest": bundle.index.manifest}
        if bundle.layout is not layouts.TRITON:
            head["layout"] = bundle.layout.name
        del entries

        def started(forked: bool) -> None:
            flusher.start()
            # written (and fsynced) while the workers stage, not before they start: only the receipt needs it
            cache.write_receipt_index(bundle.digest, bundle.index_bytes, bundle.signature, durable=durable)
            if forked:  # the workers have their own copies: this process needs only keys and objects now
                job.entries = ()
                bundle.release()

        if progress:
            progress(0, len(keys))
        with _Flusher(staging if durable else None) as flusher:
            settled = [s for chunk in workers_.run(_settle_range, tasks, job, processes=processes, workers=n,
                                                   done=count, started=started) for s in chunk]
        kept = {key: s[2] for key, s in zip(keys, settled) if s[0] == KEPT}
        res.present, res.kept = sum(s[0] != STAGED for s in settled), len(kept)
        res.bytes_fetched = sum(s[3] for s in settled)
        size = own.size if own is not None else sum(s[4] for s in settled)  # the same index: the same bytes
        stamps = [s[1] for s in settled]
        todo = [i for i, s in enumerate(settled) if s[0] == STAGED]
        agrees = own is not None and own.kept == kept and _latest_for_its_keys(own, later)
        if not todo and agrees and all(own.entries[k][1] == st for k, st in zip(keys, stamps)):
            res.noop = True
            return
        # from here on a key, an object name and a stamp per entry: the index is written beside the receipt
        head["bytes"] = size
        settled = job = None  # let them go
        bundle.release()
        if durable:
            syncfs(staging)  # every staged file on disk before a rename makes it visible
        # phase 2: one rename per entry (a key dir is either absent or complete), then the receipt
        res.replaced = _place_entries(keys, todo, cache_dir, staging, stamps)
        res.installed = len(todo)
        if durable:  # the renames on disk before the receipt that describes them (a nested layout's: in many dirs)
            (syncfs if bundle.layout.nested else fsync_dir)(cache_dir)
        # a refresh keeps its place; a new install takes a number no receipt nor history has named
        seq = own.seq if agrees else max([r.seq for r in receipts] + [n for r in receipts for n in r.history],
                                         default=0) + 1
        head["history"] = install_history(receipts, seq)
        _write_receipt(cache, bundle, source, seq, head, zip(keys, objects, stamps), kept, durable)
    except BaseException:
        if own is None:  # the index (and signature) written beside a receipt that will not be
            for suffix in (".index", ".sig"):
                cache.receipt(res.index_digest).with_suffix(suffix).unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _tasks(count: int, workers: int) -> list[tuple[int, int]]:
    """Ranges of entries for forked workers, shrinking towards the end (each half a worker's share of what is left,
    1 to 64 entries): few round trips, and the workers finish together instead of one idling through another's last
    range."""
    tasks, start = [], 0
    while start < count:
        step = max(1, min(64, (count - start) // (workers * 2)))
        tasks.append((start, start + step))
        start += step
    return tasks


def _latest_for_its_keys(own: Receipt, later: list[Receipt]) -> bool:
    """No install after ``own`` recorded other files under one of its keys (else re-installing it must win them
    back, and its receipt become the latest). Compared by object first; the files only where those differ."""
    return all(r.identity(k) == own.identity(k) or set(r.files(k)) == set(own.files(k))
               for r in later for k in r.entries.keys() & own.entries.keys())


def _write_receipt(cache: CacheDir, bundle: StoredBundle, source: str, seq: int, head: dict, rows,
                   kept: dict[str, tuple[FileRecord, ...]], durable: bool) -> None:
    cache.write_receipt(bundle.digest, {
        **head,
        "seq": seq,
        "source": source,
        "signed_by": bundle.signed_by,
        "cache_dir": str(cache.root),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # for people; order is seq's
        "kept": {k: [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in files]
                 for k, files in sorted(kept.items())},
    }, rows, durable=durable)


# --- durability -------------------------------------------------------------------------------------------------


class _Flusher:
    """While staging goes on, write what it staged back to disk every quarter second, so that the flush before the
    renames finds little left: the data goes out while the cores parse and hash (every second left up to a second's
    writes to that flush). Started once the workers are forked."""

    def __init__(self, path: Path | None, every: float = 0.25):
        self.path, self.every, self.stop, self.thread = path, every, threading.Event(), None

    def start(self) -> None:
        if self.path is not None:
            self.thread = threading.Thread(target=self._run, name="prewarm-flush", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                syncfs(self.path)
            except OSError:
                return

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
