"""Install a bundle into a node's cache dir: verified, atomic, locked, idempotent, merging. The dir is of the bundle's
layout (prewarm.shipping.layouts: Triton's cache, sglang's JIT cache, FlashInfer's AOT dir; by default the one its server
reads), and a dir of another layout is refused; the work is the same for each.

Order of work (the paths are ``CacheDir``'s, prewarm.shipping.cachedir): read the index bytes and check a present
signature (against the trusted keys when given or one is required; else under the key it carries: one that does not
verify is never ignored) -> the dir's layout (``CacheDir.check_layout``: the one it states, or the one whose server
reads it) -> check the bundle's fingerprint against this node (the one place that judges the node: ``check_node``;
the node's own factors are reused while nothing they are computed from changed: prewarm.shipping.nodestamp) -> the
bundle's build sequence against the latest install of its name (``check_sequence``) -> only then write: take the
dir's ``install_lock`` (judging layout and sequence again under it) -> decide what is to do:

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
the cache; so is its place (a link there, or in a parent's place, is refused, never followed nor replaced) and, for a
JIT layout, every file it lists and its module's header (prewarm.shipping.payload). A refused install leaves the dir
as it was: a rename that fails puts back the entries placed before it, and what it wrote under ``.prewarm`` goes.

Durability (``durable``), each flush where the order after a crash depends on it: the cache's filesystem is flushed
once (``syncfs``) after staging and before the first rename, so that a key dir never becomes visible with
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
import stat as stat_
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import layouts, nodestamp, payload
from ..building import workers as workers_
from .bundle import (DIR_FLAGS, INDEX, MAX_INDEX_BYTES, MAX_SIGNATURE_BYTES, OBJECTS, SIGNATURE, Entry, FileRecord,
    Index, index_top, is_runtime_module, parse_index, read_bounded, unpack_object)
from .cachedir import CacheDir, EntryState, Receipt, fsync_dir, install_history, latest_owners, stamp, syncfs
from ..errors import (DowngradeRefused, EnvironmentProblem, FingerprintMismatch, IntegrityError, SignatureError,
    StoreError)
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
    top: dict = field(default_factory=dict)  # the index's fields after its entries (bundle.index_top)

    @property
    def name(self) -> str | None:
        """The bundle's name, which its builds share: its manifest's (signed with the index); None where none."""
        return (self.top.get("manifest") or {}).get("name") or None

    @property
    def sequence(self) -> int:
        """Its build's sequence (bundle.py); 0 where the index carries none."""
        return self.top.get("sequence") or 0

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
    signed_by = None
    try:
        sig = _read_blob(store, SIGNATURE, MAX_SIGNATURE_BYTES)
    except FileNotFoundError:
        sig = None
    except IntegrityError as e:  # larger than any signature, or not the blob the registry lists
        raise SignatureError(f"{e}: not a signature") from None
    if trusted_keys or require_signature:
        from . import signing

        signed_by = signing.verify(data, sig, list(trusted_keys), where)
    elif sig is not None:  # present: checked under the key it carries, never ignored (not kept: no key trusted it)
        from . import signing

        signing.self_check(data, sig, where)
        sig = None
    top = index_top(data, where)
    return StoredBundle(store, data, hashlib.sha256(data).hexdigest(), signed_by, where, sig,
                        layouts.get(top.get("layout", "triton")), top)


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
    parents: set[str] = field(default_factory=set)  # parent dirs found to be plain dirs (a nested layout's)


def _stale(keys: list[str]) -> list[str]:
    """The keys whose entry is no longer as its receipt stamped it (a no-op's check: an lstat per entry)."""
    job: _Job = workers_.shared()
    root = str(job.cache.root)
    return [key for key in keys if stamp(f"{root}/{key}") != job.recorded[key][1] or not job.recorded[key][1]]


def _settle_range(start: int, stop: int) -> list[tuple]:
    job = workers_.shared()
    return [_settle(job, job.entries[i]) for i in range(start, stop)]


def _settle(job: _Job, e: Entry) -> tuple:
    """One entry: as its own receipt left it (by stamp), present by content, kept as built, or staged. Refused
    (before anything is placed) where its place or a parent of it is a link, or (a JIT layout) a file it lists is
    not one its library's loader reads, or its module is not native code (prewarm.shipping.payload)."""
    cache = job.cache
    layout = cache.layout
    root = str(cache.root)
    if layout.nested:
        _plain_parents(root, e.key, job.parents)
    files = None
    if layout.payload:  # a JIT entry's few files, checked by name before a byte of it is fetched
        files = e.files
        payload.check_listed(layout, e.key, [f.path for f in files], job.bundle.where)
    recorded = job.recorded.get(e.key)
    before = stamp(f"{root}/{e.key}")
    if not before:
        _no_link(root, e.key)
    if recorded and recorded[1] and before == recorded[1] and recorded[0] == e.object:
        _native(job, e.key, files, root)
        return (KEPT, before, job.own_kept[e.key], 0, 0) if e.key in job.own_kept else (PRESENT, before, None, 0, 0)
    files = files or e.files  # decoded, checked here: a malformed record stops the install before anything placed
    size = sum(f.size for f in files)
    if before:  # there: by content (an absent entry is simply staged)
        c = cache.entry_state(e.key, files)
        if c.intact or is_runtime_module(files) and kept_as_built(files, c, _recorded(job, e.key)):
            _native(job, e.key, files, root)
            after = cache.stamp(e.key)  # changed while it was read: not vouched for by this stamp
            return (PRESENT if c.intact else KEPT, before if before == after else "",
                    None if c.intact else tuple(c.on_disk), 0, size)
    fetched = _stage_entry(job.bundle, e, files, cache.root, job.staging)
    _native(job, e.key, files, str(job.staging))
    return STAGED, "", None, fetched, size


def _plain_parents(root: str, key: str, known: set[str]) -> None:
    """Each parent dir of a nested entry below ``root`` must be absent or a plain dir: a link there would have the
    rename write wherever it leads (EnvironmentProblem before anything is placed; ``_open_parent`` checks again as it
    renames). ``known``: parents already found plain."""
    parts = key.split("/")[:-1]
    for n in range(1, len(parts) + 1):
        parent = "/".join(parts[:n])
        if parent in known:
            continue
        try:
            st = os.lstat(f"{root}/{parent}")
        except FileNotFoundError:
            return  # made by the install, 0755
        if not stat_.S_ISDIR(st.st_mode):
            raise EnvironmentProblem(f"{root}/{key}: its parent {parts[n - 1]!r} is a link or a file, never followed "
                                     f"(installing into {root}; nothing was placed)")
        known.add(parent)


def _no_link(root: str, key: str) -> None:
    """An entry's own place must not be a link (EnvironmentProblem before anything is placed): neither followed nor
    replaced, since whoever planted it may mean it (the dir it leads to is left as it is; remove the link to install
    here). Called where the entry is not a dir (an absent one: one failing lstat)."""
    path = f"{root}/{key}"
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    if stat_.S_ISLNK(st.st_mode):
        raise EnvironmentProblem(f"{path}: entry {key}'s place is a link (to {_link_target(path)}), never followed nor "
                                 f"replaced (installing into {root}; nothing was placed): remove it to install here")


def _link_target(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError as e:
        return f"unreadable: {e.strerror}"


def _native(job: _Job, key: str, files: tuple[FileRecord, ...] | None, where: str) -> None:
    """A JIT entry's module, as staged or found under ``where``, must be native code (payload.check_native)."""
    if files is None:
        return
    module = payload.module(job.cache.layout, key)
    if any(f.path == module for f in files):
        payload.check_native(job.cache.layout, key, payload.read_head(f"{where}/{key}/{module}"), job.bundle.where)


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
    are opened once: no path is walked per entry. All or nothing: where a rename fails (a link planted in a parent's
    place since the entries were checked, a dir the install may not write), every entry placed before it is renamed
    back into staging, what it replaced put back and the parents it made removed, then the error is raised."""
    replaced = 0
    placed: list[tuple[str, bool, list[str]]] = []  # (key, replaced a dir, the parents made for it)
    cache_fd = os.open(cache_dir, DIR_FLAGS)
    try:
        staging_fd = os.open(staging, DIR_FLAGS)
        try:
            for i in todo:
                made: list[str] = []
                try:
                    aside = _place_entry(keys[i], cache_fd, staging_fd, made)
                except OSError as e:
                    _remove_made(made, cache_fd)
                    raise OSError(e.errno, e.strerror, str(cache_dir / keys[i])) from None
                placed.append((keys[i], aside, made))
                replaced += aside
                stamps[i] = stamp(keys[i], dir_fd=cache_fd)
        except BaseException as e:
            if failed := _put_back(placed, cache_fd, staging_fd):
                raise EnvironmentProblem(f"{e}; then {len(failed)} of the {len(placed)} entries placed before it could "
                                         f"not be put back: {'; '.join(failed[:5])}") from None
            raise
        finally:
            os.close(staging_fd)
    finally:
        os.close(cache_fd)
    return replaced


def _put_back(placed: list[tuple[str, bool, list[str]]], cache_fd: int, staging_fd: int) -> list[str]:
    """Undo ``_place_entry`` for each of ``placed``, last first: the entry back into staging, the dir it replaced
    back in its place, the parents made for it removed. What could not be undone, named."""
    failed = []
    for key, aside, made in reversed(placed):
        try:
            os.rename(key, key, src_dir_fd=cache_fd, dst_dir_fd=staging_fd)
            if aside:
                os.rename("old-" + key.replace("/", "%"), key, src_dir_fd=staging_fd, dst_dir_fd=cache_fd)
        except OSError as e:
            failed.append(f"{key}: {e.strerror}")
        _remove_made(made, cache_fd)
    return failed


def _remove_made(made: list[str], cache_fd: int) -> None:
    for parent in reversed(made):  # innermost first; one another entry now fills is left
        try:
            os.rmdir(parent, dir_fd=cache_fd)
        except OSError:
            return


def _place_entry(key: str, cache_fd: int, staging_fd: int, made: list[str]) -> bool:
    """Rename a staged entry into place (a nested key: into its parent dir, made where missing: appended to
    ``made``); returns whether it replaced an existing (incomplete or other) dir, set aside in staging."""
    parent, _, leaf = key.rpartition("/")
    dest_fd = _open_parent(cache_fd, parent, made) if parent else cache_fd
    try:
        try:
            os.rename(key, leaf, src_dir_fd=staging_fd, dst_dir_fd=dest_fd)
            return False
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
        aside = "old-" + key.replace("/", "%")  # no key holds a '%'
        os.rename(leaf, aside, src_dir_fd=dest_fd, dst_dir_fd=staging_fd)  # what did not match: set aside
        try:
            os.rename(key, leaf, src_dir_fd=staging_fd, dst_dir_fd=dest_fd)
        except OSError:
            os.rename(aside, leaf, src_dir_fd=staging_fd, dst_dir_fd=dest_fd)  # back in its place
            raise
        return True
    finally:
        if dest_fd != cache_fd:
            os.close(dest_fd)


def _open_parent(cache_fd: int, parent: str, made: list[str]) -> int:
    """The dir ``parent`` below the cache dir, opened; each part made where missing (0755, appended to ``made``) and
    none followed as a link (ELOOP), so that an entry is never renamed through a link out of the cache dir."""
    fd = cache_fd
    parts = parent.split("/")
    try:
        for n, part in enumerate(parts, 1):
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
                made.append("/".join(parts[:n]))
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
    allow_downgrade: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> InstallResult:
    """Install ``source`` (a bundle dir or store URL) into ``cache_dir`` (default: the dir the server of the bundle's
    layout reads, by that layout's own variable; layouts.NoNodeDir where none is named): every entry checked and
    staged first, then one rename per entry, then the receipt. ``recheck``: every entry checked by content, stamps or
    not (what a file rewritten in place needs). ``allow_downgrade``: install an older build of a bundle name than
    the one last installed here (DowngradeRefused otherwise). ``progress(entries settled, entries to settle)`` as
    the work goes.

    A refusal leaves the dir as it was: everything that can be judged without the lock (signature, the dir's layout,
    the node's fingerprint and toolchain, the bundle's sequence) is judged before anything is written; what is judged
    under the lock (each entry: its objects, its files, links in its place or its parents' places) before the first
    rename; a rename that fails puts back every entry placed before it (``_place_entries``); and what the install
    wrote into ``.prewarm`` (the dir itself where it made it, its lock, the layout's mark) is removed again."""
    t0 = time.monotonic()
    bundle = read_bundle(
        source, trusted_keys=trusted_keys, require_signature=require_signature, storage_options=storage_options
    )
    cache_dir = Path(os.path.abspath(cache_dir or bundle.layout.node_dir()))
    cache = CacheDir(cache_dir, bundle.layout)
    for d in (cache_dir, cache.meta):
        if os.path.lexists(d) and not d.is_dir():
            raise EnvironmentProblem(f"{d}: exists and is not a directory (installing into {cache_dir})")
    cache.check_layout()  # one cache dir, one layout: its server reads no other
    own = cache.receipt_of(bundle.digest)  # the index it names is this one, checked whole when installed
    built = own.fingerprint if own else bundle.index.fingerprint
    res = InstallResult(cache_dir, bundle.digest, len(own.entries) if own else len(bundle.index.entries),
                        signed_by=bundle.signed_by)
    node, record = nodestamp.node_factors(bundle.layout, cache.meta if cache.meta.is_dir() else None)
    res.mismatches = check_node(built, node, cache_dir, allow_fingerprint_mismatch, allow_missing_factors)
    cache.claim_toolchain(node, check_only=True)
    check_sequence(bundle, cache.receipts(strict=False), cache_dir, allow_downgrade)
    made = _missing(cache.meta)  # what this install makes (the meta dir, the cache dir), outermost first
    had = set() if made else set(os.listdir(cache.meta))
    try:
        cache.meta.mkdir(parents=True, exist_ok=True)
        import filelock

        lock = filelock.FileLock(str(cache.install_lock), timeout=lock_timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            _forget(cache, made, had)
            raise EnvironmentProblem(
                f"{cache.install_lock}: another install held the lock for over {lock_timeout:.0f} s"
            ) from None
        try:
            try:
                cache.claim_layout()
                # One cache dir, one Ascend toolchain: Triton's key cannot tell them apart (no-op on CUDA).
                cache.claim_toolchain(node)
                _install_locked(bundle, source, cache, res, workers, durable, recheck, allow_downgrade, progress)
            except BaseException:
                _forget(cache, made, had)  # under the lock: no other install is filling the dir
                raise
        finally:
            lock.release()
    except OSError as e:  # store errors are StoreError / IntegrityError by now: this is the local machine
        raise EnvironmentProblem(f"{e.filename or cache_dir}: {e.strerror} (installing into {cache_dir})") from None
    if record is not None:  # this node's factors for the next install or verify (only where this one went through)
        nodestamp.remember(cache.meta, record)
    res.seconds = time.monotonic() - t0
    return res


def check_sequence(bundle: StoredBundle, receipts: list[Receipt], cache_dir: Path, allow_downgrade: bool) -> bool:
    """Refuse (DowngradeRefused, both sequences named) a bundle whose build sequence is below that of the latest
    install of its name into this dir (its manifest's name: a bundle without one is compared with none), unless
    ``allow_downgrade``. Returns whether the latest install of its name is a build of another sequence: this one
    then takes a new number (a re-install of it is no no-op), so that the latest install of a name is always the
    build last installed over another (an allowed downgrade, or the upgrade after one)."""
    if bundle.name is None:
        return False
    same = [r for r in receipts if r.name == bundle.name]
    latest = max(same, key=lambda r: r.seq, default=None)
    if latest is None:
        return False
    if bundle.sequence >= latest.sequence or allow_downgrade:
        return bundle.sequence != latest.sequence
    raise DowngradeRefused(
        f"{bundle.where}: bundle {bundle.name!r} sequence {bundle.sequence} is older than sequence {latest.sequence} "
        f"of {bundle.name!r} last installed into {cache_dir} (install #{latest.seq}, index {latest.digest[:16]}...): "
        f"refusing a downgrade (--allow-downgrade installs it; an index without a sequence is sequence 0)")


def _missing(path: Path) -> list[Path]:
    """``path`` and each of its parents that does not exist, outermost first."""
    out = []
    while not os.path.lexists(path) and path != path.parent:
        out.append(path)
        path = path.parent
    return out[::-1]


def _forget(cache: CacheDir, made: list[Path], had: set[str]) -> None:
    """What a refused install wrote into the dir's ``.prewarm`` goes again: the dirs it made (``made``, the meta dir
    among them), else every name of the meta dir that was not there before (``had``: its lock, the layout's mark).
    Under the lock or before it is taken: no other install writes there meanwhile (filelock's waiters re-check a lock
    file removed while held)."""
    if made:
        shutil.rmtree(cache.meta, ignore_errors=True)
        for d in reversed(made[:-1]):  # the dirs above it, where the install left nothing else in them
            try:
                os.rmdir(d)
            except OSError:
                break
        return
    try:
        now = set(os.listdir(cache.meta))
    except OSError:
        return
    for name in sorted(now - had):
        path = cache.meta / name
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            pass


def _workers(workers: int | None, processes: bool) -> int:
    return workers or (workers_.cores() if processes else min(8, max(2, workers_.cores())))  # threads: a store's latency


def _install_locked(bundle: StoredBundle, source: str, cache: CacheDir, res: InstallResult, workers: int | None,
                    durable: bool, recheck: bool, allow_downgrade: bool, progress: Callable[[int, int], None] | None):
    cache_dir = cache.root
    for old in cache.staging_dirs():  # left by a killed install; only the lock holder stages
        shutil.rmtree(old, ignore_errors=True)
    receipts = cache.receipts(strict=False)
    # judged again under the lock (an install may have finished meanwhile)
    renumber = check_sequence(bundle, receipts, cache_dir, allow_downgrade)
    own = next((r for r in receipts if r.digest == res.index_digest), None)
    later = [r for r in receipts if own is not None and r.seq > own.seq]
    local = type(bundle.store).__name__ == "LocalStore"
    recorded = own.entries if own is not None and not recheck else {}
    if recorded and not renumber and _latest_for_its_keys(own, later):
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
        if bundle.index.sequence is not None:
            head["sequence"] = bundle.index.sequence
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
        agrees = own is not None and not renumber and own.kept == kept and _latest_for_its_keys(own, later)
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
