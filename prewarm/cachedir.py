"""A Triton cache dir as prewarm sees it: the one owner of its layout, of "is this entry intact", and of how a file
is written whole.

    <cache>/<KEY>/                                  Triton's entries (key dirs); other top-level names are skipped
    <cache>/.prewarm/build-info.json                what `prewarm build` built here, and under which toolchain
    <cache>/.prewarm/build.lock                     one build into the dir at a time
    <cache>/.prewarm/install.lock                   one install at a time (every rank of a node may start one)
    <cache>/.prewarm/staging-<pid>-<rand>/<KEY>/    an install's staged entries: same filesystem, one rename into place
    <cache>/.prewarm/receipts/<index sha256>.json   what each install put here (verify and `prewarm ls` read them)
    <cache>/.prewarm/toolchain.json                 the Ascend toolchain the dir is claimed for (Triton's key misses it)

Nothing under ``.prewarm`` is ever packed or judged as a cache entry (no key dir name starts with a dot).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .bundle import (CHUNK, KEY_RE, MAX_GROUP_BYTES, MAX_INDEX_BYTES, FileRecord, Index, is_group, open_regular,
                     parse_index, read_bounded, relative_group)
from .errors import FingerprintMismatch, IntegrityError, PrewarmError
from .fingerprint import Mismatch, compare, toolchain_factors

META = ".prewarm"
IN_FLIGHT = "tmp.pid_"  # Triton's FileCacheManager writes into such a dir, then renames the files into the entry


# --- writing a file whole ---------------------------------------------------------------------------------------------


def write_atomic(path: str | os.PathLike, data: bytes, *, durable: bool = True, mode: int = 0o666) -> None:
    """Write ``path`` whole or not at all: a temp file in the same dir, renamed over ``path``. A reader sees the old
    file or the new one; a failed write (full or read-only disk) leaves no temp file and the old file as it was.
    ``durable``: the data and the rename are on disk when this returns (fsync of the file, then of the dir); a caller
    writing many files passes False and flushes them all at once. ``mode`` as for os.open (the umask applies)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
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


def stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes whenever a file's bytes do (any write moves ctime, which no tool can set back)."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


# --- receipts -------------------------------------------------------------------------------------------------------


@dataclass
class Receipt:
    """What one install left: the bundle's index, a sequence number (later installs win where bundles share a
    key) and the entries it found on disk and kept with other bytes than the bundle's (runtime-built C modules)."""

    path: Path
    seq: int
    index: Index
    kept: dict[str, tuple[FileRecord, ...]]
    doc: dict  # the whole receipt (source, signed_by, installed_at: for people)

    def files(self) -> dict[str, tuple[FileRecord, ...]]:
        return {e.key: self.kept.get(e.key, e.files) for e in self.index.entries}

    def unchanged(self) -> dict[str, dict[str, tuple[FileRecord, tuple]]]:
        """{key: {path: (record, stat key)}} as this install left them (install's fast path; verify always hashes).
        A malformed or partial stat table only costs hashing."""
        try:
            table = self.doc.get("stat") or {}
            return {key: {f.path: (f, tuple(table[key][f.path])) for f in files if f.path in table.get(key, ())}
                    for key, files in self.files().items()}
        except (AttributeError, TypeError):
            return {}


def installed_files(receipts: list[Receipt]) -> dict[str, tuple[FileRecord, ...]]:
    """Each installed key's files as the latest receipt naming it recorded them."""
    out: dict[str, tuple[FileRecord, ...]] = {}
    for r in receipts:  # in sequence order: later installs win
        out.update(r.files())
    return out


def _load_receipt(path: Path) -> Receipt:
    where = f"install receipt {path}"
    try:
        doc = json.loads(read_bounded(open_regular(path, where), 2 * MAX_INDEX_BYTES, where))
        index = parse_index(doc["index"].encode(), where)
        if index.digest != path.stem:
            raise ValueError(f"it holds index {index.digest}")
        seq = doc.get("seq", 0)  # receipts written before sequence numbers: oldest
        if type(seq) is not int:
            raise TypeError(f"seq {seq!r}")
        keys = {e.key for e in index.entries}
        kept = {}
        for k, files in doc.get("kept", {}).items():
            if k not in keys:
                raise ValueError(f"kept entry {k!r} is not in its index")
            kept[k] = tuple(FileRecord(f["path"], f["sha256"], f["size"]) for f in files)
        if any(type(f.path) is not str or type(f.sha256) is not str or type(f.size) is not int
               for files in kept.values() for f in files):
            raise TypeError("kept file records")
    except PrewarmError as e:
        raise IntegrityError(f"{e}: re-install its bundle, or delete the receipt if that bundle is gone") from None
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"{where} is unreadable ({type(e).__name__}: {e}): re-install its bundle, or delete "
                             "the receipt if that bundle is gone") from None
    return Receipt(path, seq, index, kept, doc)


# --- the dir ----------------------------------------------------------------------------------------------------------


class CacheDir:
    """A Triton cache dir: where prewarm keeps its own files in it, its entries, and their state."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.meta = self.root / META
        self.build_info = self.meta / "build-info.json"
        self.build_lock = self.meta / "build.lock"
        self.install_lock = self.meta / "install.lock"
        self.receipts_dir = self.meta / "receipts"
        self.toolchain = self.meta / "toolchain.json"

    def __repr__(self) -> str:
        return f"CacheDir({str(self.root)!r})"

    # --- entries

    def entries(self) -> tuple[list[str], list[str]]:
        """Keys of the entries (key dirs), sorted, and the top-level names skipped (stray files, links); ``.prewarm``
        is neither."""
        keys, skipped = [], []
        for d in sorted(os.scandir(self.root), key=lambda d: d.name):
            if d.name == META:
                continue
            (keys if d.is_dir(follow_symlinks=False) and KEY_RE.match(d.name) else skipped).append(d.name)
        return keys, skipped

    def files(self, key: str, *, in_flight: bool = True) -> list[str]:
        """Everything under an entry that is not a directory (links and FIFOs included), relative, "/"-separated,
        sorted; [] when the entry is absent or unreadable. ``in_flight=False``: without Triton's ``tmp.pid_*`` dirs
        (a compile writing into the entry right now, or a killed one's leftovers)."""
        names = sorted(_listing(str(self.root / key)))
        return names if in_flight else [n for n in names if not (n.startswith(IN_FLIGHT) and "/" in n)]

    def entry_state(self, key: str, files: tuple[FileRecord, ...] | None = None,
                    unchanged: dict[str, tuple[FileRecord, tuple]] | None = None) -> EntryState:
        """The one "is this entry intact". With ``files`` (a bundle's or a receipt's listing): every listed file
        hashed (group files in their relative form: install wrote them absolute), what is not listed is unexpected.
        Without: the entry as Triton's runtime would find it, through its group files (each child present in this
        entry dir); nothing is hashed. Never follows a link or opens anything but a regular file.
        ``unchanged`` (install's fast path): {path: (record, stat key)} of files hashed or written by the last
        install of this bundle; a file whose stat key is still that one holds that record's bytes and is not read."""
        if files is None:
            return self._group_state(key)
        base = f"{self.root}/{key}"
        c = EntryState()
        names = {f.path.rsplit("/", 1)[-1] for f in files}
        for f in files:
            rel, path = f"{key}/{f.path}", f"{base}/{f.path}"
            try:
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                c.missing.append(rel)
                continue
            if not stat.S_ISREG(st.st_mode):
                c.modified.append(f"{rel} ({'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a regular file'})")
                continue
            known = (unchanged or {}).get(f.path)
            if known is not None and known[1] == stat_key(st):
                c.on_disk.append(known[0])
                if (known[0].sha256, known[0].size) != (f.sha256, f.size):
                    c.modified.append(rel)
                continue
            try:
                with open_regular(path) as fh:
                    if is_group(f.path):
                        data = fh.read(MAX_GROUP_BYTES + 1)
                        data, out = relative_group(data, key, names, path, base)
                        if out:  # reported as pointing outside, not also as modified
                            c.outside += [f"{rel} -> {p}" for p in out]
                            continue
                        sha, size = hashlib.sha256(data), len(data)
                    else:
                        sha, size = hashlib.sha256(), 0
                        for chunk in iter(lambda: fh.read(CHUNK), b""):  # hashlib releases the GIL: parallel
                            sha.update(chunk)
                            size += len(chunk)
            except (OSError, IntegrityError):  # replaced under us, unreadable, or not a group file any more
                c.modified.append(rel)
                continue
            c.hashed += size
            c.on_disk.append(FileRecord(f.path, sha.hexdigest(), size))
            if (sha.hexdigest(), size) != (f.sha256, f.size):
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
                with open_regular(entry / name) as fh:
                    children = json.loads(fh.read(MAX_GROUP_BYTES + 1))["child_paths"]
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

    def receipts(self, *, strict: bool = True) -> list[Receipt]:
        """The install receipts in install order. An unreadable one is an IntegrityError naming it (``strict``) or
        skipped (install: it rewrites its own, and checks content, not receipts)."""
        out = []
        for p in sorted(self.receipts_dir.glob("*.json")):
            try:
                out.append(_load_receipt(p))
            except IntegrityError:
                if strict:
                    raise
        return sorted(out, key=lambda r: (r.seq, r.path.name))

    def write_receipt(self, index_digest: str, doc: dict) -> None:
        self.receipts_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.receipt(index_digest), json.dumps(doc, sort_keys=True).encode())

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

    def claim_toolchain(self, node_fp: dict[str, str]) -> None:
        """Refuse a dir filled under another Ascend toolchain (FingerprintMismatch), else claim it for ours (a no-op
        where Triton's key covers the toolchain: CUDA)."""
        if conflicts := self.toolchain_conflicts(node_fp):
            lines = "; ".join(f"{m.factor}: the cache dir has {m.built!r}, this node has {m.node!r} ({m.why})"
                              for m in conflicts)
            raise FingerprintMismatch(
                f"{self.root} holds Triton entries from another Ascend toolchain, which Triton's cache key cannot tell "
                f"apart (they would be reused silently): {lines}. Use a fresh cache dir for this toolchain, or empty "
                f"this one."
            )
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
