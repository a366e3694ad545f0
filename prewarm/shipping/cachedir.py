"""A cache dir as prewarm sees it: the one owner of where prewarm keeps its own files in it, of "is this entry
intact", and of how a file is written whole. How entries are named and found is the dir's layout's (prewarm.shipping.layouts:
Triton's key dirs below, sglang's JIT leaves, FlashInfer's AOT modules); everything else is the same for each.

    <cache>/<KEY>/                                  Triton's entries (key dirs); other top-level names are skipped
    <cache>/.prewarm/build-info.json                what `prewarm build` built here, and under which toolchain
    <cache>/.prewarm/build.lock                     one build into the dir at a time (there only while one runs)
    <cache>/.prewarm/install.lock                   one install at a time (every rank of a node may start one)
    <cache>/.prewarm/staging-<pid>-<rand>/<KEY>/    an install's staged entries: same filesystem, one rename into place
    <cache>/.prewarm/receipts/<index sha256>.json   what each install put here (verify and `prewarm ls` read them):
                                                    its entries with their object and stamp, what it kept, and the
                                                    install history (every earlier install's number and index)
    <cache>/.prewarm/receipts/<index sha256>.index  the installed bundle's index, verbatim (its sha256 is its name)
    <cache>/.prewarm/receipts/<index sha256>.sig    its signature, where install checked it (--trust): the proof
                                                    `verify --trust` checks the index by, whoever can write here
    <cache>/.prewarm/node.json                      this node's fingerprint and the stamp of what it was computed from
    <cache>/.prewarm/toolchain.json                 the Ascend toolchain the dir is claimed for (Triton's key misses it)
    <cache>/.prewarm/layout                         the dir's layout, where not Triton's (layouts.mark, install)

Nothing under ``.prewarm`` is ever packed or judged as a cache entry (no key dir name starts with a dot).
"""
from __future__ import annotations

import errno
import functools
import hashlib
import itertools
import json
import os
import stat
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping

from . import layouts
from .bundle import (CHUNK, DIR_FLAGS, MAX_GROUP_BYTES, MAX_INDEX_BYTES, Entry, FileRecord, Index, is_group,
    open_regular, parse_index, read_bounded, relative_group)
from ..errors import EnvironmentProblem, FingerprintMismatch, IntegrityError, PrewarmError

if TYPE_CHECKING:  # annotations only: fingerprint is imported where a toolchain is judged
    from ..node.fingerprint import Mismatch

META = layouts.META  # no entry of any layout
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
IN_FLIGHT = "tmp.pid_"  # Triton's FileCacheManager writes into such a dir, then renames the files into the entry


# --- writing a file whole ---------------------------------------------------------------------------------------------


def write_atomic(path: str | os.PathLike, data: bytes | list[bytes], *, durable: bool = True,
                 mode: int = 0o666) -> None:
    """Write ``path`` whole or not at all: a temp file in the same dir, renamed over ``path``. A reader sees the old
    file or the new one; a failed write (full or read-only disk) leaves no temp file and the old file as it was.
    ``durable``: the data and the rename are on disk when this returns (fsync of the file, then of the dir); a caller
    writing many files passes False and flushes them all at once. ``mode`` as for os.open (the umask applies).
    ``data``: bytes, or a list of pieces written in turn."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.writelines([data] if isinstance(data, bytes) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a write or a flush (a full disk): name the file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the renames inside ``path`` survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def syncfs(path: str | os.PathLike) -> None:
    """Flush the filesystem holding ``path``: one call for every file written there, however many (Linux syncfs;
    not every filesystem of the node as sync does, which a busy node's other tenants would make slow)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if (call := _libc_syncfs()) is None or call(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1)
def _libc_syncfs():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


# --- the state of one entry -----------------------------------------------------------------------------------------


@dataclass
class EntryState:
    """One key dir as it is on disk: against the files a bundle or receipt lists for it, or (no listing) as Triton's
    runtime would find it through its group files."""

    modified: list[str] = field(default_factory=list)  # listed files with other bytes; links; unreadable groups
    missing: list[str] = field(default_factory=list)  # listed (or a group's children) but absent
    unexpected: list[str] = field(default_factory=list)  # not listed: stray files, links, Triton's tmp.pid_* leftovers
    outside: list[str] = field(default_factory=list)  # group children that are not files of this entry dir
    on_disk: list[FileRecord] = field(default_factory=list)  # the listed paths that are regular files, as they are
    groups: dict[str, tuple[str, ...] | None] = field(default_factory=dict)  # group -> its children (None: unreadable)
    hashed: int = 0

    @property
    def intact(self) -> bool:
        return not (self.modified or self.missing or self.unexpected or self.outside)


def _hash_fd(fd: int, size: int) -> tuple[str, int]:
    """(sha256, bytes) of an open file: read whole when at most CHUNK (most of a cache: one read), else in CHUNKs."""
    if size < CHUNK:
        data = os.read(fd, size + 1)  # one more: a file that grew since fstat shows as its real size
        return hashlib.sha256(data).hexdigest(), len(data)
    sha, n = hashlib.sha256(), 0
    while data := os.read(fd, CHUNK):
        sha.update(data)  # hashlib releases the GIL: threads hash in parallel
        n += len(data)
    return sha.hexdigest(), n


# --- stamps: has an entry changed? ----------------------------------------------------------------------------------


def stamp(path: str | os.PathLike, *, dir_fd: int | None = None) -> str:
    """An entry dir's stamp: its inode, mtime and ctime (and those of each dir below it), no content, no file read.
    The same stamp means no file or dir was added, removed, renamed or replaced in it since: each of those moves the
    dir's mtime and ctime, and ctime cannot be set back (Triton and most tools write a file whole and rename it in).
    A file rewritten in place (same inode) does not show: ``prewarm verify`` hashes every file, ``install(recheck=
    True)`` too; and a change within the same clock tick as the stamp was taken may not show either (as git's "racy"
    files). One lstat per entry: a dir's link count is 2 + its subdirs on ext4, xfs and tmpfs, so only a dir with
    subdirs (or on a filesystem that counts otherwise) is listed. '' where the path is not a directory. ``dir_fd``:
    ``path`` is relative to that open dir (as os.lstat's)."""
    try:
        st = os.lstat(path, dir_fd=dir_fd)
    except OSError:
        return ""
    if not stat.S_ISDIR(st.st_mode):
        return ""
    own = f"{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    if st.st_nlink == 2:
        return own
    try:
        fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return ""
    try:
        subdirs = sorted(d.name for d in os.scandir(fd) if d.is_dir(follow_symlinks=False))
        return "|".join([own] + [f"{name}/{stamp(name, dir_fd=fd)}" for name in subdirs])
    except OSError:
        return ""
    finally:
        os.close(fd)


# --- receipts -------------------------------------------------------------------------------------------------------

RECEIPT_FORMAT = 2
MAX_RECEIPT_BYTES = MAX_INDEX_BYTES  # ~200 bytes per entry


@dataclass
class Receipt:
    """What one install left: a sequence number (later installs win where bundles share a key), each entry's object
    and stamp as the install left it, the entries it found on disk and kept with other bytes than the bundle's
    (runtime-built C modules), the install history (so that a deleted receipt is noticed by a later one), and the
    bundle's index beside it (``index``: read when needed) with its signature where install checked one."""

    path: Path
    seq: int
    digest: str  # the index's sha256
    entries: dict[str, tuple[str, str]]  # key -> (object name, stamp or "" where not taken)
    kept: dict[str, tuple[FileRecord, ...]]
    fingerprint: dict[str, str]
    manifest: dict | None
    size: int  # the listed files' bytes
    doc: dict  # the whole receipt (source, signed_by, installed_at: for people)
    history: dict[int, str] = field(default_factory=dict)  # install number -> its index digest ("": not known)
    layout: str = "triton"  # its bundle's (prewarm.shipping.layouts)

    @property
    def signature_path(self) -> Path:
        return self.path.with_suffix(".sig")

    @property
    def name(self) -> str | None:
        """Its bundle's name (the manifest's), which builds of one bundle share; None where it names no manifest."""
        return (self.manifest or {}).get("name") or None

    @property
    def sequence(self) -> int:
        """Its bundle's build sequence (bundle.py); 0 where its index carries none (packed before sequences)."""
        return self.doc.get("sequence") or 0

    @functools.cached_property
    def index_bytes(self) -> bytes:
        """The installed index's bytes, read from beside the receipt; IntegrityError unless their sha256 is the
        receipt's name. Let go once ``index`` is parsed."""
        if (embedded := self.doc.get("index")) is not None:  # receipts of prewarm 0.1 held it inline
            return embedded.encode()
        where = f"install receipt {self.path}: its index {self.path.with_suffix('.index')}"
        try:
            data = read_bounded(open_regular(self.path.with_suffix(".index"), where), MAX_INDEX_BYTES, where)
        except OSError as e:
            raise IntegrityError(f"{where} is unreadable ({e.strerror}): {_REINSTALL}") from None
        if hashlib.sha256(data).hexdigest() != self.digest:
            raise IntegrityError(f"{where} does not hold index {self.digest}: edited or corrupted; {_REINSTALL}")
        return data

    @functools.cached_property
    def index(self) -> Index:
        """The installed index, read from beside the receipt (its sha256 must be the receipt's name)."""
        index = parse_index(self.index_bytes, f"install receipt {self.path}: its index", check_files=False)
        self.__dict__.pop("index_bytes", None)  # parsed: the bytes are not needed again
        return index

    @functools.cached_property
    def _by_key(self) -> dict[str, Entry]:
        return {e.key: e for e in self.index.entries}

    def read_index(self) -> None:
        """Read the index now (a caller about to fork workers that will all need it)."""
        self._by_key  # noqa: B018

    def files(self, key: str) -> tuple[FileRecord, ...]:
        """The files this install recorded for ``key``: as kept on disk, else the bundle's."""
        return self.kept[key] if key in self.kept else self._by_key[key].files

    def listed(self, key: str) -> tuple[FileRecord, ...]:
        """The files the bundle's index lists for ``key`` (what its signature covers)."""
        return self._by_key[key].files

    def identity(self, key: str) -> tuple:
        """What this install recorded for ``key``, comparable across receipts without reading an index."""
        return self.entries[key][0], self.kept.get(key)


def install_history(receipts: list[Receipt], seq: int) -> dict[str, str]:
    """What a new receipt numbered ``seq`` records of the other installs: every number a receipt or a receipt's
    history names, with its index digest, and "" for a number below ``seq`` that none names (vacated before receipts
    kept a history). A receipt deleted later is still named by this one (verify reports it)."""
    known: dict[int, str] = {}
    for r in receipts:
        for n, digest in r.history.items():
            if digest or n not in known:
                known[n] = digest
    known.update((r.seq, r.digest) for r in receipts if r.seq > 0)  # receipts of prewarm 0.1 have no number
    known.pop(seq, None)
    for n in range(1, seq):
        known.setdefault(n, "")
    return {str(n): digest for n, digest in sorted(known.items())}


def latest_owners(receipts: list[Receipt]) -> dict[str, Receipt]:
    """Each installed key -> the latest receipt naming it (what is on disk is that install's)."""
    out: dict[str, Receipt] = {}
    for r in receipts:  # in sequence order: later installs win
        out.update(dict.fromkeys(r.entries, r))
    return out


def _records(files, what: str) -> tuple[FileRecord, ...]:
    if type(files) is not list or not all(type(f) is dict and type(f.get("path")) is str and type(f.get("sha256"))
                                         is str and type(f.get("size")) is int for f in files):
        raise TypeError(f"{what} is not a list of file records")
    return tuple(FileRecord(f["path"], f["sha256"], f["size"]) for f in files)


_REINSTALL = ("re-install its bundle; if that bundle is gone, empty the cache dir (verify reports a deleted "
              "receipt)")

# A receipt carries the sha256 of its own bytes with that field zeroed: its first field, so no re-encoding is needed
# to check it, and any flipped byte shows.
_SUM_AT, _UNSUMMED = b'{"checksum":"', "0" * 64


def _is_count(v) -> bool:
    return type(v) is int and v >= 0


def _receipt_sum(data: bytes) -> str:
    h = hashlib.sha256(_SUM_AT + _UNSUMMED.encode())
    h.update(memoryview(data)[len(_SUM_AT) + 64:])
    return h.hexdigest()


def _load_receipt(path: Path) -> Receipt:
    where = f"install receipt {path}"
    try:
        data = read_bounded(open_regular(path, where), MAX_RECEIPT_BYTES, where)
        if data.startswith(_SUM_AT) and data[len(_SUM_AT):len(_SUM_AT) + 64] != _receipt_sum(data).encode():
            raise ValueError("its checksum does not match its content: corrupted or edited")
        doc = json.loads(data)
        seq = doc.get("seq", 0)  # receipts written before sequence numbers: oldest
        if type(seq) is not int:
            raise TypeError(f"seq {seq!r}")
        r = Receipt(path, seq, path.stem, {}, {}, {}, None, 0, doc)
        if "index" in doc:  # prewarm 0.1: the index inline, no stamps
            index = r.index
            if index.digest != path.stem:
                raise ValueError(f"it holds index {index.digest}")
            r.entries = {e.key: (e.object, "") for e in index.entries}
            r.fingerprint, r.manifest, r.size = index.fingerprint, index.manifest, index.total_size
            r.layout = index.layout
        else:
            if doc.get("format") != RECEIPT_FORMAT or doc.get("index_digest") != path.stem or "checksum" not in doc:
                raise ValueError(f"format {doc.get('format')!r} for index {doc.get('index_digest')!r}")
            entries, fp, manifest, size = doc["entries"], doc["fingerprint"], doc["manifest"], doc["bytes"]
            if type(entries) is not dict or type(fp) is not dict or type(size) is not int or not (
                    manifest is None or type(manifest) is dict):
                raise TypeError("entries, fingerprint, manifest or bytes")
            r.layout = doc.get("layout", layouts.TRITON.name)  # written where not Triton's
            key_re = layouts.get(r.layout).key_re
            for key, v in entries.items():
                if not (key_re.fullmatch(key) and type(v) is list and len(v) == 2 and type(v[0]) is str
                        and type(v[1]) is str):
                    raise ValueError(f"entry {key!r}: {v!r}")
            r.entries = {k: tuple(v) for k, v in entries.items()}
            r.fingerprint, r.manifest, r.size = fp, manifest, size
        for k, files in doc.get("kept", {}).items():
            if k not in r.entries:
                raise ValueError(f"kept entry {k!r} is not in its index")
            r.kept[k] = _records(files, f"kept entry {k!r}")
        if not _is_count(doc.get("sequence", 0)):  # receipts written before sequences: none
            raise TypeError(f"sequence {doc.get('sequence')!r}")
        history = doc.get("history", {})  # receipts written before the history: none
        if type(history) is not dict or not all(n.isdigit() and type(d) is str for n, d in history.items()):
            raise TypeError("history")
        r.history = {int(n): d for n, d in history.items()}
    except PrewarmError as e:
        raise IntegrityError(f"{e}: {_REINSTALL}") from None
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"{where} is unreadable ({type(e).__name__}: {e}): {_REINSTALL}") from None
    return r


# --- the dir ----------------------------------------------------------------------------------------------------------


class CacheDir:
    """A cache dir: where prewarm keeps its own files in it, its entries (as its ``layout`` names them: given, else
    the one the dir states), and their state."""

    def __init__(self, root: str | os.PathLike, layout: layouts.Layout | None = None):
        self.root = Path(root)
        self.meta = self.root / META
        self.build_info = self.meta / "build-info.json"
        self.build_lock = self.meta / "build.lock"
        self.install_lock = self.meta / "install.lock"
        self.receipts_dir = self.meta / "receipts"
        self.toolchain = self.meta / "toolchain.json"
        self.layout_file = self.meta / layouts.LAYOUT_FILE
        self._loaded: dict[Path, tuple[tuple, Receipt]] = {}
        if layout is not None:
            self.__dict__["layout"] = layout

    @contextmanager
    def building(self) -> Iterator[None]:
        """One build into the dir at a time: ``build.lock`` held for the body and removed before it is released,
        whether the build ends or fails, so that no lock file is left for a reader to take as a stale lock (the
        kernel drops a lock whose process died, so even a killed build never blocks the next one). Removing it is
        race-free with filelock >= 4 (pyproject.toml): a build that waited on the removed file finds it unlinked once
        it gets the lock, and takes a new one."""
        from filelock import FileLock

        with FileLock(str(self.build_lock)):
            try:
                yield
            finally:
                self.build_lock.unlink(missing_ok=True)

    @functools.cached_property
    def layout(self) -> layouts.Layout:
        """The layout the dir states (``layout_file``); Triton's where it states none."""
        return layouts.stated(self.root) or layouts.TRITON

    def check_layout(self, environ: Mapping[str, str] = os.environ) -> None:
        """Refuse (EnvironmentProblem naming both) to fill this dir with entries of ``layout`` where it is another
        layout's: it says so, or installs left receipts without saying (a Triton dir), or, stating no layout, it is
        where another layout's server reads in ``environ`` (that layout's variable names it, or it is that server's
        default dir and the variable is unset): the dir a variable names is its layout's, whatever bundle comes
        first. Reads only (install calls it before it writes anything)."""
        have = layouts.stated(self.root)
        if have is None and any(self.receipts_dir.glob("*.json")):
            have, told = layouts.TRITON, "its install receipts"
        else:
            told = str(self.layout_file)
        if have is not None:
            layouts.refuse_other(self.root, have, self.layout, told)
        if layouts.stated(self.root) is not None:
            return
        here = os.path.realpath(self.root)
        for other in layouts.known().values():
            try:
                theirs = other.node_dir(environ)
            except layouts.NoNodeDir:
                continue
            if other is not self.layout and os.path.realpath(theirs) == here:
                why = (f"{other.env_var}={environ[other.env_var]} names it" if environ.get(other.env_var) else
                       f"its server's default dir, {other.env_var} being unset")
                own = f" or set {self.layout.env_var}" if self.layout.env_var else ""
                raise EnvironmentProblem(
                    f"{self.root} is where {other.name} entries are read ({why}) and it states no layout "
                    f"({self.layout_file} absent): refusing to put {self.layout.name} entries into it; give a dir a "
                    f"{self.layout.name} server reads (--cache-dir{own})")

    def claim_layout(self) -> bool:
        """:meth:`check_layout`, then state the dir's layout where not Triton's (absent is Triton's: every Triton dir
        stays as it was); whether this call wrote the mark."""
        self.check_layout()
        if self.layout is layouts.TRITON or layouts.stated(self.root) is not None:
            return False
        layouts.mark(self.root, self.layout.name)
        return True

    def __repr__(self) -> str:
        return f"CacheDir({str(self.root)!r})"

    # --- entries

    def entries(self) -> tuple[list[str], list[str]]:
        """Keys of the entries, sorted, and the names skipped (stray files, links); ``.prewarm`` is neither."""
        return self.layout.entries(self.root)

    def files(self, key: str, *, in_flight: bool = True) -> list[str]:
        """Everything under an entry that is not a directory (links and FIFOs included), relative, "/"-separated,
        sorted; [] when the entry is absent or unreadable. ``in_flight=False``: without Triton's ``tmp.pid_*`` dirs
        (a compile writing into the entry right now, or a killed one's leftovers)."""
        names = sorted(_listing(str(self.root / key)))
        return names if in_flight else [n for n in names if not (n.startswith(IN_FLIGHT) and "/" in n)]

    def stamp(self, key: str) -> str:
        """The entry's stamp (``stamp``): '' where it is not a directory."""
        return stamp(self.root / key)

    def entry_state(self, key: str, files: tuple[FileRecord, ...] | None = None) -> EntryState:
        """The one "is this entry intact". With ``files`` (a bundle's or a receipt's listing): every listed file
        hashed (group files in their relative form: install wrote them absolute), what is not listed is unexpected.
        Without: the entry as Triton's runtime would find it, through its group files (each child present in this
        entry dir); nothing is hashed (past Triton: nothing to judge). Never follows a link or opens anything but a
        regular file."""
        if files is None:
            return self._group_state(key) if self.layout.groups else EntryState()
        base = f"{self.root}/{key}"
        c = EntryState()
        names = {f.path.rsplit("/", 1)[-1] for f in files}
        for f in files:
            rel, path = f"{key}/{f.path}", f"{base}/{f.path}"
            try:
                fd = os.open(path, _READ_FLAGS)  # never a link, never blocking on a FIFO
            except (FileNotFoundError, NotADirectoryError):
                c.missing.append(rel)
                continue
            except OSError as e:
                c.modified.append(f"{rel} (a symlink)" if e.errno == errno.ELOOP else rel)
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    c.modified.append(f"{rel} (not a regular file)")
                    continue
                if self.layout.groups and is_group(f.path):
                    # as much as it holds (a buffer of the bound per file costs more than hashing it), one byte
                    # more: a file that grew shows
                    data = os.read(fd, min(st.st_size, MAX_GROUP_BYTES) + 1)
                    data, out = relative_group(data, key, names, path, base)
                    if out:  # reported as pointing outside, not also as modified
                        c.outside += [f"{rel} -> {p}" for p in out]
                        continue
                    digest, size = hashlib.sha256(data).hexdigest(), len(data)
                else:
                    digest, size = _hash_fd(fd, st.st_size)
            except (OSError, IntegrityError):  # unreadable, or not a group file any more
                c.modified.append(rel)
                continue
            finally:
                os.close(fd)
            c.hashed += size
            c.on_disk.append(FileRecord(f.path, digest, size))
            if (digest, size) != (f.sha256, f.size):
                c.modified.append(rel)
        listed = {f.path for f in files}
        c.unexpected = [f"{key}/{n}" for n in self.files(key) if n not in listed]
        return c

    def _group_state(self, key: str) -> EntryState:
        """Each group file's children must be regular files of this very entry dir: a child elsewhere (a copied
        cache's old location) makes Triton read another dir's files, or recompile when that dir is gone."""
        c = EntryState()
        entry = self.root / key
        real = os.path.realpath(entry)
        for name in self.files(key):
            if "/" in name or not is_group(name):
                continue
            try:
                with open_regular(entry / name) as fh:  # as much as it holds, not a buffer of the bound each
                    data = fh.read(min(os.fstat(fh.fileno()).st_size, MAX_GROUP_BYTES) + 1)
                children = json.loads(data)["child_paths"]
                if not isinstance(children, dict):
                    raise TypeError("child_paths is not an object")
            except (OSError, IntegrityError, ValueError, RecursionError, KeyError, TypeError):
                # unreadable, not JSON, not a group: Triton ignores it and compiles
                c.groups[name] = None
                c.modified.append(f"{key}/{name} (not a Triton group file)")
                continue
            c.groups[name] = tuple(children)
            for p in map(str, children.values()):
                head, _, child = p.replace("\\", "/").rpartition("/")
                if not head or os.path.realpath(head) != real:
                    c.outside.append(f"{key}/{name} -> {p}")
                elif not os.path.isfile(entry / child) or os.path.islink(entry / child):
                    c.missing.append(f"{key}/{child}")
        return c

    # --- prewarm's own files

    def read_build_info(self) -> dict:
        """What `prewarm build` built here, or {} when absent or unreadable (a cache no build wrote)."""
        try:
            doc = json.loads(read_bounded(open_regular(self.build_info), MAX_INDEX_BYTES, str(self.build_info)))
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError, RecursionError, IntegrityError):
            return {}

    def write_build_info(self, doc: dict) -> None:
        self.meta.mkdir(parents=True, exist_ok=True)
        write_atomic(self.build_info, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())

    def receipt(self, index_digest: str) -> Path:
        return self.receipts_dir / f"{index_digest}.json"

    def receipt_of(self, index_digest: str) -> Receipt | None:
        """The receipt an install of this very index left, where there is a readable one."""
        try:
            return self._receipt(self.receipt(index_digest)) if self.receipt(index_digest).is_file() else None
        except IntegrityError:
            return None

    def _receipt(self, path: Path) -> Receipt:
        """A receipt, read and checked once by this CacheDir while its file stays the one that was read (a receipt
        is replaced whole: another inode)."""
        try:
            st = os.stat(path)
        except OSError as e:
            raise IntegrityError(f"install receipt {path} is unreadable ({e.strerror})") from None
        key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if (known := self._loaded.get(path)) is None or known[0] != key:
            known = self._loaded[path] = key, _load_receipt(path)
        if known[1].layout != self.layout.name:
            raise IntegrityError(f"install receipt {path} is of a {known[1].layout} bundle, in a {self.layout.name} "
                                 f"dir ({self.layout_file}): {_REINSTALL}")
        return known[1]

    def receipts(self, *, strict: bool = True, faults: list[str] | None = None) -> list[Receipt]:
        """The install receipts in install order. An unreadable one is an IntegrityError naming it (``strict``),
        its message appended to ``faults`` (verify: it reports them all), or skipped (install: it rewrites its own,
        and checks content, not receipts)."""
        out = []
        for p in sorted(self.receipts_dir.glob("*.json")):
            try:
                out.append(self._receipt(p))
            except IntegrityError as e:
                if faults is not None:
                    faults.append(str(e))
                elif strict:
                    raise
        return sorted(out, key=lambda r: (r.seq, r.path.name))

    def write_receipt_index(self, index_digest: str, index_bytes: bytes, signature: bytes | None = None, *,
                            durable: bool = True) -> None:
        """The installed index (and its checked signature), beside where its receipt will be (written first: a
        receipt never names an index that is not there; an index without its receipt is only a leftover, replaced by
        the next install of it)."""
        self.receipts_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.receipt(index_digest).with_suffix(".index"), index_bytes, durable=durable)
        self.keep_signature(index_digest, signature, durable=durable)

    def keep_signature(self, index_digest: str, signature: bytes | None, *, durable: bool = True) -> None:
        """The signature install checked for this index, beside it (written only where it differs: a repeated
        install stays a no-op that writes nothing); None: nothing to keep."""
        path = self.receipt(index_digest).with_suffix(".sig")
        try:  # never blocking on a FIFO put there: anything but the same bytes is replaced
            same = signature is None or read_bounded(open_regular(path), len(signature), str(path)) == signature
        except (OSError, IntegrityError):
            same = False
        if not same:
            write_atomic(path, signature, durable=durable)

    def write_receipt(self, index_digest: str, doc: dict, rows, *, durable: bool = True) -> None:
        """The receipt: ``doc`` and each entry's (key, object, stamp) from ``rows``, written in pieces (keys, object
        names and stamps are plain ASCII: no JSON object per entry is built, nor the whole text at once)."""
        head, _, tail = json.dumps({**doc, "format": RECEIPT_FORMAT, "index_digest": index_digest, "entries": None},
                                   sort_keys=True, separators=(",", ":")).partition('"entries":null')
        rows = iter(rows)
        pieces = [_SUM_AT + _UNSUMMED.encode() + b'",' + head[1:].encode() + b'"entries":{']
        while chunk := [f'"{key}":["{obj}","{st}"]' for key, obj, st in itertools.islice(rows, 4096)]:
            pieces.append(("," * (len(pieces) > 1) + ",".join(chunk)).encode())
        pieces.append(b"}" + tail.encode())
        checksum = hashlib.sha256()
        for piece in pieces:
            checksum.update(piece)
        pieces[0] = _SUM_AT + checksum.hexdigest().encode() + pieces[0][len(_SUM_AT) + 64:]
        write_atomic(self.receipt(index_digest), pieces, durable=durable)

    # One cache dir, one Ascend toolchain: Triton's key cannot tell two CANN / bishengir-compile toolchains apart, so
    # the runtime would reuse the old binaries silently. The first install (or NPU build) into a dir claims it for its
    # toolchain; a later one under another toolchain is refused. A dir that already holds kernels but no claim
    # (filled by the runtime itself) has an unknown toolchain: refused too.

    def read_toolchain(self) -> dict[str, str] | None:
        """The Ascend toolchain factors the dir is claimed for; None when unclaimed."""
        if not self.toolchain.is_file():
            return None
        try:
            return json.loads(self.toolchain.read_text())["factors"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"{self.toolchain}: not a toolchain record ({e}); delete it only if the dir is "
                                 f"empty") from None

    def toolchain_conflicts(self, node_fp: dict[str, str]) -> list[Mismatch]:
        """Why filling this dir on a node of fingerprint ``node_fp`` would mix toolchains; [] when it is safe."""
        from ..node.fingerprint import Mismatch, compare, toolchain_factors  # only where a toolchain is to be judged

        ours = toolchain_factors(node_fp)
        if not ours:
            return []
        recorded = self.read_toolchain()
        if recorded is not None:
            return [m for m in compare(recorded, ours) if m.blocking and m.factor.startswith("ascend.")]
        if not self.root.is_dir():
            return []
        # a kernel is an entry with a group file (the NPU driver's own npu_utils.so, which it writes into the dir as
        # it starts, is none: every fresh dir would look used)
        kernels = [key for key in self.entries()[0] if any(map(is_group, self.files(key)))]
        if kernels:
            return [Mismatch("ascend.cache_dir", f"{len(kernels)} kernels, toolchain not recorded",
                             "this node's toolchain", True,
                             f"filled outside prewarm (no {self.toolchain}): its Ascend toolchain is unknown")]
        return []

    def claim_toolchain(self, node_fp: dict[str, str], *, check_only: bool = False) -> None:
        """Refuse a dir filled under another Ascend toolchain (FingerprintMismatch), else claim it for ours (a no-op
        where Triton's key covers the toolchain: CUDA; ``check_only``: refuse only, writing nothing)."""
        if not any(f.startswith("ascend.") for f in node_fp):  # fingerprint.toolchain_factors: none, nothing to claim
            return
        if conflicts := self.toolchain_conflicts(node_fp):
            lines = "; ".join(f"{m.factor}: the cache dir has {m.built!r}, this node has {m.node!r} ({m.why})"
                              for m in conflicts)
            raise FingerprintMismatch(
                f"{self.root} holds Triton entries from another Ascend toolchain, which Triton's cache key cannot tell "
                f"apart (they would be reused silently): {lines}. Use a fresh cache dir for this toolchain, or empty "
                f"this one."
            )
        if check_only:
            return
        from ..node.fingerprint import toolchain_factors

        if ours := toolchain_factors(node_fp):
            self.meta.mkdir(parents=True, exist_ok=True)
            write_atomic(self.toolchain, json.dumps({"factors": ours}, indent=2, sort_keys=True).encode())

    def staging_dirs(self) -> list[Path]:
        """Install staging dirs (a killed install leaves its own behind; only the lock holder stages)."""
        return sorted(self.meta.glob("staging-*"))

    def new_staging(self) -> Path:
        d = self.meta / f"staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        d.mkdir()
        return d


def _listing(base: str, prefix: str = "") -> list[str]:
    try:
        items = list(os.scandir(base))
    except OSError:  # absent, not a dir, unreadable: the listed files say what is wrong
        return []
    out = []
    for d in items:
        if d.is_dir(follow_symlinks=False):
            out += _listing(d.path, f"{prefix}{d.name}/")
        else:
            out.append(prefix + d.name)
    return out
