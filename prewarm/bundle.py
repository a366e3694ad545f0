"""The bundle format: its index, one cache entry's object (``pack_entry``) and reading a bundle back without
trusting it. Packing a whole cache dir is pack.py's; installing one, install.py's.

Bundle layout (a directory, or the same names under any fsspec URL)::

    objects/<sha256>.tar.zst   one per cache entry (key dir); the name is the sha256 of the object's bytes
    index.json.sig             optional Ed25519 signature over the exact bytes of index.json (written first)
    index.json                 written last: a reader never sees an index whose objects or signature are missing

An object is a deterministic tar of one key dir's files (sorted names, mtime 0, uid/gid 0, no user names, mode
0644 or 0755) compressed with zstd (level 3, content size in the frame). Group files (``__grp__*.json``) are
stored with child paths *relative to their entry* (``{"child_paths": {"k.cubin": "k.cubin"}}``): no path of the
build box survives, and install rewrites them to the real absolute location.

``index.json`` (canonical JSON: sorted keys, no timestamps, so the same cache packs to the same bytes)::

    {"checksum", "format": 1, "tool": "prewarm 0.1.0", "fingerprint": {factor: value}, "manifest": {name, digest} | null,
     "entries": [{"key", "object", "object_size", "tar_size",
                  "files": [{"path", "sha256", "size"}]}]}          # entries sorted by key, files by path

``checksum`` is the sha256 of the canonical JSON without it, and the bytes must be exactly that canonical form:
a flipped byte anywhere in an unsigned index is caught (a signature, when used, covers tampering).
``tar_size`` is the exact uncompressed size of the object: decompression stops there, so an object cannot expand
beyond what the (signed) index declares. ``files[].sha256`` of a group file is that of its relative form.
Nothing here executes bundle content: members are parsed as data and written with O_EXCL|O_NOFOLLOW.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

import zstandard

from . import __version__
from .errors import IntegrityError, PrewarmError, UnsafeBundleError

FORMAT = 1
INDEX = "index.json"
SIGNATURE = "index.json.sig"
OBJECTS = "objects"
GROUP_PREFIX = "__grp__"
ZSTD_LEVEL = 3

KEY_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_=-]{0,127}$")  # a cache key dir's name (never starts with a dot)
_OBJECT_RE = re.compile(r"^[0-9a-f]{64}\.tar\.zst$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_UNSAFE_PATH = re.compile(r"(?:^|/)\.{0,2}(?:/|$)|[\\\x00]")  # an empty, "." or ".." part; a backslash; NUL
_RUNTIME_MODULE = re.compile(
    r"(?:__triton_launcher|cuda_utils|launcher_cxx11abi\w*|npu_utils)(?:\.[\w-]+)*\.so|precompiled\.h(?:\.gch)?")
NAME_MAX = 255  # bytes per path component on every filesystem a cache lives on


@dataclass(frozen=True)
class FileRecord:
    path: str  # relative to the entry dir, "/"-separated
    sha256: str
    size: int


@dataclass(frozen=True)
class Entry:
    key: str
    object: str  # "<sha256>.tar.zst"
    object_size: int
    tar_size: int
    files: tuple[FileRecord, ...]


@dataclass(frozen=True)
class Index:
    fingerprint: dict[str, str]
    manifest: dict | None
    entries: tuple[Entry, ...]
    tool: str = f"prewarm {__version__}"
    format: int = FORMAT

    def to_bytes(self) -> bytes:
        return _with_checksum(self.to_doc())

    def to_doc(self) -> dict:
        entries = [
            {"key": e.key, "object": e.object, "object_size": e.object_size, "tar_size": e.tar_size,
             "files": [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in e.files]}
            for e in self.entries
        ]
        return {"format": self.format, "tool": self.tool, "fingerprint": self.fingerprint, "manifest": self.manifest,
                "entries": entries}

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def total_size(self) -> int:
        return sum(f.size for e in self.entries for f in e.files)


def _canonical(doc: dict) -> bytes:
    return (json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n").encode()


def _with_checksum(doc: dict) -> bytes:
    """Canonical JSON carrying the sha256 of its own canonical form without that field: any flipped byte shows."""
    doc = {k: v for k, v in doc.items() if k != "checksum"}
    return _canonical({**doc, "checksum": hashlib.sha256(_canonical(doc)).hexdigest()})


# --- paths and group files -----------------------------------------------------------------------------------


def check_rel_path(path: str, where: str) -> str:
    """A bundle path must be relative, normalized and stay inside its entry: refuse anything else."""
    if _UNSAFE_PATH.search(path):
        raise UnsafeBundleError(f"{where}: unsafe path {path!r} (must be relative, without '..' or empty parts)")
    try:
        parts = path.encode("utf-8").split(b"/")
    except UnicodeEncodeError:
        raise UnsafeBundleError(f"{where}: path {path!r} is not valid Unicode (a lone surrogate)") from None
    if max(map(len, parts)) > NAME_MAX or len(parts) > 64:
        raise UnsafeBundleError(f"{where}: path {path[:80]!r}... has a name over {NAME_MAX} bytes or over 64 parts")
    return path


def is_group(path: str) -> bool:
    return path.rsplit("/", 1)[-1].startswith(GROUP_PREFIX) and path.endswith(".json")


def is_runtime_module(files: tuple[FileRecord, ...]) -> bool:
    """An entry holding only C modules the runtime builds with the host compiler (CUDA: a kernel signature's
    ``__triton_launcher`` or ``cuda_utils``; Ascend: ``launcher_cxx11abi*``, ``npu_utils``, the precompiled
    header): two builds of the same source, hence the same key, differ byte for byte."""
    return bool(files) and all(_RUNTIME_MODULE.fullmatch(f.path) for f in files)


def relative_group(
    data: bytes, key: str, names: set[str], where: str, entry_dir: str | None = None
) -> tuple[bytes, list[str]]:
    """A group file in canonical relative form, and the children that point outside its entry.

    Without ``entry_dir`` (packing, reading a bundle) a child is inside when it is a bare file name of the entry
    or a path ending in ``<key>/<name>``: a cache copied from elsewhere is still recognised as its own. With
    ``entry_dir`` (checking an installed cache) it must be that very dir: a child in a copy's old location is
    exactly what makes Triton silently read another directory's files.
    """
    try:
        doc = json.loads(data)
        children = doc["child_paths"]
        assert isinstance(children, dict)
    except Exception as e:
        raise IntegrityError(f"{where}: not a Triton group file ({e.__class__.__name__}: {e})") from None
    rel, outside = {}, []
    for child, p in children.items():
        p = str(p)
        head, _, name = p.replace("\\", "/").rpartition("/")
        if entry_dir is not None:
            inside = name in names and (head == entry_dir or os.path.realpath(head or ".") == os.path.realpath(entry_dir))
        else:
            inside = name in names and (head == "" and not os.path.isabs(p) or head.rpartition("/")[2] == key)
        rel[child] = name if inside else p
        if not inside:
            outside.append(p)
    doc["child_paths"] = rel
    return json.dumps(doc, sort_keys=True).encode(), outside


def absolute_group(data: bytes, entry_dir: str) -> bytes:
    """The installed form of a (relative, already validated) group file: children at their real location."""
    doc = json.loads(data)
    doc["child_paths"] = {c: os.path.join(entry_dir, n) for c, n in doc["child_paths"].items()}
    return json.dumps(doc).encode()


# --- one entry's object --------------------------------------------------------------------------------------


def _tarinfo(path: str, size: int, executable: bool) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(path)
    ti.size, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0, 0, "", ""
    ti.mode = 0o755 if executable else 0o644
    return ti


def pack_entry(entry_dir: Path, names: list[str]) -> tuple[Entry, bytes]:
    """One key dir's files (``names``, relative) -> (its index entry, its object bytes). Deterministic for the same
    files. Links and devices are refused."""
    key = entry_dir.name
    for name in names:
        if not stat.S_ISREG(os.lstat(entry_dir / name).st_mode):
            raise UnsafeBundleError(f"{entry_dir / name}: not a regular file (links and devices are never packed)")
    nameset = set(names)
    buf = io.BytesIO()
    records = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            full = entry_dir / name
            data = full.read_bytes()
            if is_group(name):
                data, outside = relative_group(data, key, nameset, str(full))
                if outside:
                    raise IntegrityError(f"{full}: group points outside its entry: {', '.join(outside)}")
            executable = bool(os.stat(full).st_mode & 0o111)
            tar.addfile(_tarinfo(name, len(data), executable), io.BytesIO(data))
            records.append(FileRecord(name, hashlib.sha256(data).hexdigest(), len(data)))
    raw = buf.getvalue()
    obj = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)
    name = hashlib.sha256(obj).hexdigest() + ".tar.zst"
    return Entry(key, name, len(obj), len(raw), tuple(records)), obj


# --- reading a bundle without trusting it --------------------------------------------------------------------


def _expect(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise UnsafeBundleError(f"{where}: malformed index: {what}")


def parse_index(data: bytes, where: str) -> Index:
    """Validate and load index bytes. Every path, key and object name is checked before anything uses it."""
    try:
        doc = json.loads(data)
        assert isinstance(doc, dict)
    except (ValueError, AssertionError, RecursionError) as e:
        raise IntegrityError(f"{where}: index is not a JSON object ({type(e).__name__}: {e}): corrupted") from None
    body = {k: v for k, v in doc.items() if k != "checksum"}
    # canonical bytes begin with '{"checksum":"<64 hex>",' (the first key in sorted order): the rest is the body
    head = b'{"checksum":"' + str(doc.get("checksum")).encode() + b'",'
    if (
        _canonical(doc) != data
        or not data.startswith(head)
        or doc["checksum"] != hashlib.sha256(b"{" + data[len(head):]).hexdigest()
    ):
        raise IntegrityError(f"{where}: index checksum does not match its content: corrupted or edited")
    _expect(doc.get("format") == FORMAT, where, f"format {doc.get('format')!r}, this prewarm reads {FORMAT}")
    fp = doc.get("fingerprint")
    _expect(isinstance(fp, dict) and all(isinstance(v, str) for v in fp.values()), where, "fingerprint")
    manifest = doc.get("manifest")
    _expect(manifest is None or isinstance(manifest, dict) and all(isinstance(v, str) for v in manifest.values()),
            where, "manifest")
    _expect(isinstance(doc.get("entries"), list), where, "entries is not a list")
    entries, keys = [], set()
    for i, e in enumerate(doc["entries"]):
        at = f"entries[{i}]"
        _expect(isinstance(e, dict), where, at)
        key, obj = e.get("key"), e.get("object")
        _expect(isinstance(key, str) and bool(KEY_RE.match(key)), where, f"{at}.key {key!r}")
        _expect(key not in keys, where, f"{at}.key {key!r} repeated")
        keys.add(key)
        _expect(isinstance(obj, str) and bool(_OBJECT_RE.match(obj)), where, f"{at}.object {obj!r}")
        for n in ("object_size", "tar_size"):
            _expect(isinstance(e.get(n), int) and e[n] >= 0, where, f"{at}.{n}")
        _expect(isinstance(e.get("files"), list), where, f"{at}.files is not a list")
        files, paths = [], set()
        for f in e["files"]:  # hot loop (16k files in a big cache): messages built only on failure
            path, sha, size = (f.get("path"), f.get("sha256"), f.get("size")) if isinstance(f, dict) else (0, 0, 0)
            if type(path) is not str or type(sha) is not str or type(size) is not int or size < 0:
                _expect(False, where, f"{key}: file record {f!r}")
            check_rel_path(path, f"{where}: {key}")
            if path in paths or not _SHA_RE.match(sha):
                _expect(False, where, f"{key}/{path}: listed twice or sha256 {sha!r} malformed")
            paths.add(path)
            files.append(FileRecord(path, sha, size))
        for path in paths:  # "a" and "a/b" cannot both be files
            head = path.rpartition("/")[0]
            while head:
                _expect(head not in paths, where, f"{key}/{head} is listed as a file and as a directory")
                head = head.rpartition("/")[0]
        # a tar of these files can never be smaller than their data: a lie here is caught on unpack anyway
        _expect(e["tar_size"] >= sum(f.size for f in files), where, f"{key}: tar_size below its files' sizes")
        entries.append(Entry(key, obj, e["object_size"], e["tar_size"], tuple(files)))
    index = Index(dict(fp), manifest, tuple(entries), str(doc.get("tool", "")), FORMAT)
    _expect(index.to_doc() == body, where, "fields this prewarm does not know (or of the wrong type)")
    index.__dict__["digest"] = hashlib.sha256(data).hexdigest()  # data is the canonical form (checked above)
    return index


CHUNK = 1 << 20  # every object and file is streamed in pieces of this size: memory stays O(CHUNK)
MAX_INDEX_BYTES = 256 << 20  # an index of 16k files is ~3 MB; nothing larger is read
MAX_GROUP_BYTES = 16 << 20  # group files are small JSON: they are validated in memory


class _Reader:
    """Reads at most ``limit`` bytes from ``f`` (``too_long()`` is raised beyond), hashing what passes."""

    def __init__(self, f, limit: int, too_long):
        self.f, self.limit, self.too_long, self.n, self.sha = f, limit, too_long, 0, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        size = CHUNK if size is None or size < 0 else size
        data = self.f.read(max(0, min(size, self.limit + 1 - self.n)))
        self.n += len(data)
        if self.n > self.limit:
            raise self.too_long()
        self.sha.update(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


def open_regular(path: str | os.PathLike, where: str | None = None):
    """Open a local file for reading, refusing anything but a regular file (a FIFO would hang, /dev/zero never
    ends) before a byte is read. IntegrityError naming ``where``; FileNotFoundError when absent."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise IntegrityError(f"{where or path}: not a regular file (mode {st.st_mode:o}): refused before reading")
    return os.fdopen(fd, "rb", buffering=0)


def read_bounded(f, limit: int, where: str) -> bytes:
    """All of ``f``, refusing more than ``limit`` bytes (an index, a signature, a receipt)."""
    with f:
        return b"".join(iter(_Reader(f, limit, lambda: IntegrityError(f"{where}: larger than {limit} bytes")).read,
                             b""))


def unpack_object(stream, entry: Entry, dest: str, final_dir: str, where: str) -> int:
    """Check one object against its entry while writing its files into a fresh ``dest`` dir; returns its size.

    One pass, O(CHUNK) memory: the object is read up to ``object_size`` (its sha256 must be its name), decompressed
    up to ``tar_size`` (an object cannot expand beyond what the index declares), parsed as a stream of members, each
    a plain regular file without setuid/setgid/sticky bits at a safe path, listed in the index, of the listed size
    and sha256; the members are exactly the listed files. Group files must be in relative form and are written
    pointing at ``final_dir`` (where the entry will live). Files are created with O_EXCL|O_NOFOLLOW. Any failure
    leaves a partial ``dest``: the caller stages into a dir it removes. A corrupted object is reported as such (its
    hash) rather than by whatever its corruption broke first.
    """
    where = f"{where} (entry {entry.key})"
    obj = f"object {entry.object}"
    raw = _Reader(stream, entry.object_size,
                  lambda: IntegrityError(f"{where}: {obj} is larger than the {entry.object_size} bytes the index lists"))
    try:
        tar_stream = _Reader(zstandard.ZstdDecompressor().stream_reader(raw, read_size=CHUNK, closefd=False),
                             entry.tar_size, lambda: UnsafeBundleError(
                                 f"{where}: {obj} decompresses to more than {entry.tar_size} bytes, the index declares "
                                 f"{entry.tar_size}"))
        _unpack_members(tar_stream, entry, dest, final_dir, where, obj)
        tar_stream.drain()  # the tar's zero blocks up to exactly tar_size
        if tar_stream.n != entry.tar_size:
            raise UnsafeBundleError(f"{where}: {obj} decompresses to {tar_stream.n} bytes, the index declares "
                                    f"{entry.tar_size}")
        raw.drain()
    except (PrewarmError, zstandard.ZstdError, tarfile.TarError, EOFError) as e:
        _check_object_hash(raw, entry, where, obj)  # corruption first: it explains whatever broke
        if isinstance(e, PrewarmError):
            raise
        raise IntegrityError(f"{where}: {obj} is not a valid zstd-compressed tar ({type(e).__name__}: {e})") from None
    _check_object_hash(raw, entry, where, obj)
    return raw.n


def check_object(stream, entry: Entry, where: str) -> None:
    """IntegrityError unless ``stream`` holds exactly ``entry``'s object (size and sha256); read in pieces."""
    with stream:
        obj = f"object {entry.object}"
        _check_object_hash(_Reader(stream, entry.object_size, lambda: IntegrityError(
            f"{where}: {obj} is larger than the {entry.object_size} bytes the index lists")), entry, where, obj)


def _check_object_hash(raw: _Reader, entry: Entry, where: str, obj: str) -> None:
    raw.drain()  # bounded by object_size (raises beyond)
    digest = raw.sha.hexdigest()
    if digest + ".tar.zst" != entry.object or raw.n != entry.object_size:
        raise IntegrityError(f"{where}: {obj} has sha256 {digest} and {raw.n} bytes (the index lists "
                             f"{entry.object_size}): corrupted or tampered")


def _unpack_members(tar_stream: _Reader, entry: Entry, dest: str, final_dir: str, where: str, obj: str) -> None:
    expected = {f.path: f for f in entry.files}
    names = {p.rsplit("/", 1)[-1] for p in expected}
    seen: set[str] = set()
    os.mkdir(dest, 0o755)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with tarfile.open(fileobj=tar_stream, mode="r|", bufsize=CHUNK) as tar:
        for m in tar:
            path = check_rel_path(m.name, f"{where}: member")
            if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):  # not sparse/contiguous either
                kind = "symlink" if m.issym() else "hardlink" if m.islnk() else "device/fifo/dir/sparse"
                raise UnsafeBundleError(f"{where}: member {path!r} is a {kind}, only regular files are allowed")
            if m.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
                raise UnsafeBundleError(f"{where}: member {path!r} has setuid/setgid/sticky mode {m.mode:o}")
            if path not in expected or path in seen:
                raise UnsafeBundleError(f"{where}: member {path!r} is not listed in the index (or repeated)")
            seen.add(path)
            rec = expected[path]
            if m.offset_data + m.size > entry.tar_size:
                raise UnsafeBundleError(f"{where}: {obj} decompresses to more than {entry.tar_size} bytes, the index "
                                        f"declares {entry.tar_size} (member {path!r} alone is {m.size})")
            if m.size != rec.size:
                raise IntegrityError(f"{where}: {path} is {m.size} bytes, the index lists {rec.size}")
            if "/" in path:
                os.makedirs(os.path.join(dest, os.path.dirname(path)), 0o755, exist_ok=True)
            src = tar.extractfile(m)
            sha = hashlib.sha256()
            if is_group(path):
                if m.size > MAX_GROUP_BYTES:
                    raise UnsafeBundleError(f"{where}: group {path} is {m.size} bytes (at most {MAX_GROUP_BYTES})")
                data = src.read()
                sha.update(data)
                rel, outside = relative_group(data, entry.key, names, f"{where}: {path}")
                if outside or rel != data:
                    why = f"points outside its entry: {', '.join(outside)}" if outside else "is not in relative form"
                    raise UnsafeBundleError(f"{where}: group {path} {why}")
                chunks = [absolute_group(data, final_dir)]
            else:
                chunks = iter(lambda: src.read(CHUNK), b"")
            fd = os.open(os.path.join(dest, path), flags, 0o755 if m.mode & 0o111 else 0o644)
            try:
                for chunk in chunks:
                    if not is_group(path):
                        sha.update(chunk)
                    with memoryview(chunk) as view:
                        while view:
                            view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            if sha.hexdigest() != rec.sha256:
                raise IntegrityError(f"{where}: {path} has sha256 {sha.hexdigest()}, the index lists {rec.sha256}")
    if missing := sorted(set(expected) - seen):
        raise IntegrityError(f"{where}: {obj} lacks {', '.join(missing)}")
