"""The bundle format: its index, one cache entry's object (``pack_entry``) and reading a bundle back without
trusting it. Packing a whole cache dir is pack.py's; installing one, install.py's.

Bundle layout (a directory, or the same names under any fsspec URL)::

    objects/<sha256>.tar.zst   one per cache entry (key dir); the name is the sha256 of the object's bytes
    index.json.sig             optional Ed25519 signature over the exact bytes of index.json (written first)
    index.json                 written last: a reader never sees an index whose objects or signature are missing

An object is a deterministic tar of one key dir's files (sorted names, mtime 0, uid/gid 0, no user names, mode
0644 or 0755; POSIX pax format, whose only extended record is a long or non-ASCII ``path``) compressed with zstd
(level 3, content size in the frame). Group files (``__grp__*.json``) are stored with child paths *relative to
their entry* (``{"child_paths": {"k.cubin": "k.cubin"}}``): no path of the build box survives, and install rewrites
them to the real absolute location.

``index.json`` (canonical JSON: sorted keys, no timestamps, so the same cache packs to the same bytes)::

    {"checksum", "format": 1, "tool": "prewarm 0.1.0", "fingerprint": {factor: value}, "manifest": {name, digest} | null,
     "layout": "sglang-jit" | "flashinfer-aot",                    # only in a bundle of a dir past Triton
     "sequence": 1796650000,                                       # the build's sequence (pack writes it)
     "entries": [{"key", "object", "object_size", "tar_size",
                  "files": [{"path", "sha256", "size"}]}]}          # entries sorted by key, files by path

``layout`` (prewarm.shipping.layouts): the kind of cache dir the entries come from and go to; absent, Triton's (every Triton
bundle keeps the bytes it had before layouts). A key of a nested layout is its entry's path under the dir
("sm90a/sgl_kernel_jit_x/build-<hex>/deps-<hex>"); group files are Triton's only.

``sequence`` (an integer >= 0; pack writes it: ``--sequence``, by default the build's time in seconds since the epoch)
orders the builds of one bundle name (its manifest's): install refuses one older than the latest it installed under
that name unless told (``--allow-downgrade``). Signed with the rest of the index. An index without it (packed before
sequences) is sequence 0: older than any that has one.

``checksum`` is the sha256 of the canonical JSON without it, and the bytes must be exactly that canonical form:
a flipped byte anywhere in an unsigned index is caught (a signature, when used, covers tampering).
``tar_size`` is the exact uncompressed size of the object: decompression stops there, so an object cannot expand
beyond what the (signed) index declares. ``files[].sha256`` of a group file is that of its relative form.

Reading an index trusts nothing: every field has exactly its JSON type (a bool is not an integer), every key has
the form of the cache keys of the Triton the bundle was built with (``tritoncompat.key_dir_form``), or of its
layout's, part by part (``layouts.Layout.key_check``: no other name can become a dir in the cache), every object
name, path, hash and size is checked before anything uses it. A parsed index keeps its bytes and each entry's place
in them, not Python objects per file: memory is O(1) per entry however many files it lists, and an entry's file
records are decoded (and checked) when read.
Nothing here executes bundle content: members are parsed as data and written with O_EXCL|O_NOFOLLOW.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import shutil
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import zstandard

from .. import __version__
from ..errors import IntegrityError, PrewarmError, UnsafeBundleError
from . import layouts

try:
    from .. import _fastunpack
except ImportError:  # not built (no C compiler where prewarm was installed): the Python reader does it all
    _fastunpack = None

FORMAT = 1
INDEX = "index.json"
SIGNATURE = "index.json.sig"
OBJECTS = "objects"
GROUP_PREFIX = "__grp__"
ZSTD_LEVEL = 3

_OBJECT_RE = re.compile(r"[0-9a-f]{64}\.tar\.zst")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_UNSAFE_PATH = re.compile(r"(?:^|/)\.{0,2}(?:/|$)|[\\\x00]")  # an empty, "." or ".." part; a backslash; NUL
_RUNTIME_MODULE = re.compile(
    r"(?:__triton_launcher|cuda_utils|launcher_cxx11abi\w*|npu_utils)(?:\.[\w-]+)*\.so|precompiled\.h(?:\.gch)?")
NAME_MAX = 255  # bytes per path component on every filesystem a cache lives on


class FileRecord(NamedTuple):
    path: str  # relative to the entry dir, "/"-separated
    sha256: str
    size: int


class Entry:
    """One cache entry of an index. Built from its files (pack, tests), or parsed: then it holds only its place in
    the index bytes, and ``files`` decodes and checks its file records each time it is read."""

    __slots__ = ("key", "object", "object_size", "tar_size", "_files", "_src", "_span", "_i")

    def __init__(self, key: str, object: str, object_size: int, tar_size: int, files: tuple[FileRecord, ...] = ()):
        self.key, self.object, self.object_size, self.tar_size = key, object, object_size, tar_size
        self._files, self._src, self._span, self._i = tuple(files), None, (0, 0), 0

    @classmethod
    def _parsed(cls, key: str, object: str, object_size: int, tar_size: int, src: _Source, span: tuple[int, int],
                i: int) -> Entry:
        e = cls(key, object, object_size, tar_size)
        e._src, e._span, e._i = src, span, i
        return e

    @property
    def files(self) -> tuple[FileRecord, ...]:
        if self._src is None:
            return self._files
        start, end = self._span
        return _decode_files(self._src.data[start:end], self.tar_size,
                             f"{self._src.where}: malformed index: entries[{self._i}]")

    def to_json(self) -> bytes:
        """The entry's canonical JSON, as it stands in an index."""
        files = [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in self.files]
        return _dumps({"files": files, "key": self.key, "object": self.object, "object_size": self.object_size,
                       "tar_size": self.tar_size})

    def _id(self) -> tuple:
        return self.key, self.object, self.object_size, self.tar_size, self.files

    def __eq__(self, other) -> bool:
        return isinstance(other, Entry) and self._id() == other._id()

    def __hash__(self) -> int:
        return hash((self.key, self.object))

    def __repr__(self) -> str:
        return f"Entry({self.key!r}, {self.object!r}, {self.object_size}, {self.tar_size})"


@dataclass(frozen=True)
class _Source:
    """The bytes a parsed index was read from, shared by its entries."""

    data: bytes
    where: str


@dataclass(frozen=True)
class Index:
    fingerprint: dict[str, str]
    manifest: dict | None
    entries: tuple[Entry, ...]
    tool: str = f"prewarm {__version__}"
    format: int = FORMAT
    layout: str = "triton"  # prewarm.shipping.layouts: the kind of cache dir its entries are of
    sequence: int | None = None  # the build's sequence (None: an index packed before sequences, read as 0)

    def to_bytes(self) -> bytes:
        """The canonical bytes (a parsed index: the very bytes it was read from), written piece by piece: no Python
        document of the whole index is built."""
        if (src := self.__dict__.get("_source")) is not None:
            return src
        return index_bytes([e.to_json() for e in self.entries], self.fingerprint, self.manifest, self.tool, self.layout,
                           self.sequence)

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @functools.cached_property
    def total_size(self) -> int:
        return sum(f.size for e in self.entries for f in e.files)


def index_bytes(entries: list[bytes], fingerprint: dict[str, str], manifest: dict | None,
                tool: str = f"prewarm {__version__}", layout: str = "triton", sequence: int | None = None) -> bytes:
    """The canonical index of entries already in their canonical JSON (``Entry.to_json``, in key order), assembled
    piece by piece: the same bytes as the whole document encoded at once, without building it. ``layout`` is
    written only when not Triton's, ``sequence`` where given."""
    tail = {"fingerprint": fingerprint, "format": FORMAT, "manifest": manifest, "tool": tool}
    if layout != "triton":
        tail["layout"] = layout
    if sequence is not None:
        tail["sequence"] = sequence
    body = b'{"entries":[' + b",".join(entries) + b"]," + _canonical(tail)[1:]
    return b'{"checksum":"' + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:]


def _dumps(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _canonical(doc: dict) -> bytes:
    return _dumps(doc) + b"\n"


def _with_checksum(doc: dict) -> bytes:
    """Canonical JSON carrying the sha256 of its own canonical form without that field: any flipped byte shows."""
    doc = {k: v for k, v in doc.items() if k != "checksum"}
    return _canonical({**doc, "checksum": hashlib.sha256(_canonical(doc)).hexdigest()})


# --- paths and group files -----------------------------------------------------------------------------------


def check_rel_path(path: str, where: str) -> str:
    """A bundle path must be relative, normalized and stay inside its entry: refuse anything else."""
    if _UNSAFE_PATH.search(path):
        raise UnsafeBundleError(f"{where}: unsafe path {path!r} (must be relative, without '..' or empty parts)")
    if len(path) <= NAME_MAX and path.isascii() and path.count("/") < 64:
        return path  # every part fits: the common case, without encoding it
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


def _tarinfo(path: str, size: int, executable: bool):
    import tarfile

    ti = tarfile.TarInfo(path)
    ti.size, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0, 0, "", ""
    ti.mode = 0o755 if executable else 0o644
    return ti


def pack_entry(entry_dir: Path, names: list[str], key: str | None = None, groups: bool = True) -> tuple[Entry, bytes]:
    """One key dir's files (``names``, relative) -> (its index entry, its object bytes). Deterministic for the same
    files. Links and devices are refused. ``key``: the entry's (default: its dir's name; a nested layout's is its
    path under the cache dir); ``groups``: Triton's group files stored in relative form."""
    key = entry_dir.name if key is None else key
    for name in names:
        if not stat.S_ISREG(os.lstat(entry_dir / name).st_mode):
            raise UnsafeBundleError(f"{entry_dir / name}: not a regular file (links and devices are never packed)")
    import tarfile  # writing only: reading is _unpack_tar's

    nameset = set(names)
    buf = io.BytesIO()
    records = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            full = entry_dir / name
            data = full.read_bytes()
            if groups and is_group(name):
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


# --- reading an index without trusting it ----------------------------------------------------------------------
# The canonical bytes are walked, not loaded whole: '{"checksum":"<hex>","entries":[' then each entry
# '{"files":[...],"key":"K","object":"O","object_size":N,"tar_size":N}' separated by ',' then
# '],"fingerprint":{...},"format":1,"manifest":...,"tool":"..."}\n'. An unescaped '],"key":"' cannot occur inside a
# JSON string, so its first occurrence ends an entry's file list; each piece is then held to its canonical form,
# so the walk accepts exactly the canonical serialization of a valid index and nothing else.

_HEAD = re.compile(rb'\{"checksum":"([0-9a-f]{64})",')
_ENTRIES = re.compile(rb'"entries":\[')
_CHECKSUM_END = len(b'{"checksum":"') + 64 + 2  # through '",'
_FILES_AT = len(b'{"files":')
_ENTRY_TAIL = re.compile(
    rb'\],"key":"([^"\\]*)","object":"([0-9a-f]{64}\.tar\.zst)","object_size":(0|[1-9][0-9]*),'
    rb'"tar_size":(0|[1-9][0-9]*)\}')
_TOP = ("checksum", "entries", "fingerprint", "format", "manifest", "tool")
_ENTRY_FIELDS = ("files", "key", "object", "object_size", "tar_size")


def _expect(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise UnsafeBundleError(f"{where}: malformed index: {what}")


def _is_count(v) -> bool:
    """A JSON integer >= 0 (a bool is not one, nor is 1.0)."""
    return type(v) is int and v >= 0


def parse_index(data: bytes, where: str, *, check_files: bool = True) -> Index:
    """Validate and load index bytes; every key, object name and field type is checked before anything uses it.
    ``check_files``: every entry's file records too, now (else each time an entry's ``files`` is read: install
    reads them all, in parallel, before it writes anything)."""
    head = _HEAD.match(data)
    if head is None or not data.endswith(b"}\n"):
        raise IntegrityError(f"{where}: not a prewarm index (it begins {{\"checksum\":\"<sha256>\", and ends with "
                             f"}}): corrupted, truncated or another file")
    body = hashlib.sha256(b"{")
    body.update(memoryview(data)[_CHECKSUM_END:])
    if body.hexdigest() != head[1].decode():
        raise IntegrityError(f"{where}: index checksum does not match its content: corrupted or edited")
    if not data.startswith(b'"entries":[', _CHECKSUM_END):
        _expect(not data.startswith(b'"entries":', _CHECKSUM_END), where, "entries is not a list")
        _expect(False, where, f"its second field is not entries; format {FORMAT} has {', '.join(_TOP)}")
    head = _ENTRIES.match(data, _CHECKSUM_END)
    end = data.rfind(b'],"fingerprint":')
    _expect(end >= head.end(), where, f"no fingerprint right after the entries; format {FORMAT} has "
            f"{', '.join(_TOP)}")
    top = _parse_top(data[end + 2:], where)
    fp, layout = top["fingerprint"], top.get("layout", "triton")
    key_form, key_words = layouts.get(layout).key_check(fp)

    def check_key(key, i: int) -> None:
        _expect(type(key) is str and key_form.fullmatch(key) is not None, where,
                f"entries[{i}].key {key!r} is not {key_words}")

    src = _Source(data, where)
    entries, keys = [], set()
    pos = head.end()
    while pos < end:
        i = len(entries)
        stop = data.find(b'],"key":"', pos, end)
        tail = _ENTRY_TAIL.match(data, stop) if stop >= 0 and data.startswith(b'{"files":[', pos) else None
        if tail is None:
            _entry_error(data, pos, i, where, check_key)
        key = tail[1].decode("ascii", "replace")
        check_key(key, i)
        _expect(key not in keys, where, f"entries[{i}].key {key!r} repeated")
        keys.add(key)
        entries.append(Entry._parsed(key, tail[2].decode(), int(tail[3]), int(tail[4]), src,
                                     (pos + _FILES_AT, stop + 1), i))
        pos = tail.end()
        _expect(pos == end or pos + 1 < end and data[pos:pos + 1] == b",", where,
                f"entries[{i}] is not followed by ',' and another entry, or by ']'")
        pos += pos < end
    index = Index(fp, top["manifest"], tuple(entries), top["tool"], FORMAT, layout, top.get("sequence"))
    index.__dict__["_source"] = data
    index.__dict__["digest"] = hashlib.sha256(data).hexdigest()
    if check_files:
        index.__dict__["total_size"] = sum(f.size for e in entries for f in e.files)
    return index


def _parse_top(tail: bytes, where: str) -> dict:
    """The fields after the entries: '{' + what follows '],' is a JSON object of its own, in canonical form."""
    doc = b"{" + tail
    try:
        top = json.loads(doc)
    except (ValueError, RecursionError) as e:
        raise UnsafeBundleError(f"{where}: malformed index: the fields after entries are not JSON "
                                f"({type(e).__name__})") from None
    _expect(type(top) is dict and sorted(set(top) - {"layout", "sequence"}) == sorted(_TOP[2:]), where,
            f"top-level fields {sorted(top) if type(top) is dict else top!r}; format {FORMAT} has {', '.join(_TOP)} "
            f"(and layout, past Triton, and sequence)")
    if "sequence" in top:
        _expect(_is_count(top["sequence"]), where, f"sequence {top['sequence']!r} is not an integer >= 0")
    if "layout" in top:
        past = [name for name in layouts.known() if name != "triton"]
        _expect(top["layout"] in past, where, f"layout {top['layout']!r} is not one this prewarm reads "
                f"({', '.join(past)}; a Triton bundle has no layout field)")
    fmt, tool, fp, manifest = top["format"], top["tool"], top["fingerprint"], top["manifest"]
    _expect(type(fmt) is int and fmt == FORMAT, where, f"format {fmt!r}: this prewarm reads format {FORMAT} (an "
            f"integer)")
    _expect(type(tool) is str, where, f"tool {tool!r} is not a string")
    _expect(type(fp) is dict and all(type(v) is str for v in fp.values()), where,
            "fingerprint is not an object of strings")
    _expect(manifest is None or type(manifest) is dict and sorted(manifest) == ["digest", "name"]
            and all(type(v) is str for v in manifest.values()), where,
            f"manifest {manifest!r} is neither null nor {{\"name\": string, \"digest\": string}}")
    _expect(_canonical(top) == doc, where, "the fields after entries are not in canonical form")
    return top


def index_top(data: bytes, where: str) -> dict:
    """An index's fields after the entries (fingerprint, manifest, layout, sequence...), read alone: install picks
    the dir by its layout and judges its sequence before it parses the index, if it ever does. Where those are
    malformed, the error a whole read names first (a checksum that does not match, a truncated index) is raised."""
    end = data.rfind(b'],"fingerprint":')
    try:
        _expect(end >= 0, where, "no fingerprint after the entries")
        return _parse_top(data[end + 2:], where)
    except PrewarmError:
        parse_index(data, where, check_files=False)
        raise


def _entry_error(data: bytes, pos: int, i: int, where: str, check_key):
    """Why entries[i] (at ``pos``) is not a canonical entry, naming the field: the walk found it malformed."""
    at = f"entries[{i}]"
    try:
        e, _ = json.JSONDecoder().raw_decode(data[pos:].decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        _expect(False, where, f"{at} is not a JSON object")
    _expect(type(e) is dict, where, f"{at} is not an object")
    check_key(e.get("key"), i)
    obj = e.get("object")
    _expect(type(obj) is str and _OBJECT_RE.fullmatch(obj) is not None, where, f"{at}.object {obj!r} is not "
            f"<sha256>.tar.zst")
    for n in ("object_size", "tar_size"):
        _expect(_is_count(e.get(n)), where, f"{at}.{n} {e.get(n)!r} is not an integer >= 0")
    _expect(type(e.get("files")) is list, where, f"{at}.files is not a list")
    _expect(sorted(e) == list(_ENTRY_FIELDS), where, f"{at} has fields {sorted(e)}; an entry has "
            f"{', '.join(_ENTRY_FIELDS)}")
    _expect(False, where, f"{at} is not in canonical form")


# A file record as json.dumps writes it when its path needs no escape (every name Triton writes): read by this pattern
# alone. Any other spelling is decoded as JSON and must re-encode to the same bytes.
_PLAIN_RECORD = re.compile(rb'\{"path":"([ !#-\[\]-~]*)","sha256":"([0-9a-f]{64})","size":(0|[1-9][0-9]*)\}')


def _decode_files(raw: bytes, tar_size: int, at: str) -> tuple[FileRecord, ...]:
    """One entry's file records, each checked (hot: every file of every entry; messages built only on failure)."""
    out, pos, last = [], 1, len(raw) - 1
    if raw[:1] == b"[" and raw[-1:] == b"]":
        while m := _PLAIN_RECORD.match(raw, pos):
            out.append(FileRecord(m[1].decode(), m[2].decode(), int(m[3])))
            pos = m.end()
            if pos == last or raw[pos:pos + 1] != b",":
                break
            pos += 1
    if pos != last:
        out = _decode_files_json(raw, at)
    paths = set()
    for j, f in enumerate(out):
        check_rel_path(f.path, f"{at}.files[{j}]")
        if f.path in paths:
            raise UnsafeBundleError(f"{at}.files[{j}]: {f.path} is listed twice")
        paths.add(f.path)
    for path in paths:  # "a" and "a/b" cannot both be files
        head = path.rpartition("/")[0]
        while head:
            if head in paths:
                raise UnsafeBundleError(f"{at}: {head} is listed as a file and as a directory")
            head = head.rpartition("/")[0]
    # a tar of these files can never be smaller than their data: a lie here is caught on unpack anyway
    if tar_size < sum(f.size for f in out):
        raise UnsafeBundleError(f"{at}: tar_size below its files' sizes")
    return tuple(out)


def _decode_files_json(raw: bytes, at: str) -> list[FileRecord]:
    """The general case: file records decoded as JSON, each field of its type, the list in canonical form."""
    try:
        records = json.loads(raw)
    except (ValueError, RecursionError):
        records = None
    if type(records) is not list:
        raise UnsafeBundleError(f"{at}.files is not a JSON list of file records")
    out = []
    for j, f in enumerate(records):
        path, sha, size = (f.get("path"), f.get("sha256"), f.get("size")) if type(f) is dict else (0, 0, 0)
        if type(path) is not str or type(sha) is not str or not _is_count(size) or len(f) != 3:
            raise UnsafeBundleError(f"{at}.files[{j}]: file record {f!r} is not {{\"path\": string, \"sha256\": "
                                    f"string, \"size\": integer >= 0}}")
        if _SHA_RE.fullmatch(sha) is None:
            raise UnsafeBundleError(f"{at}.files[{j}].sha256 {sha!r} is not a sha256 (64 lowercase hex)")
        out.append(FileRecord(path, sha, size))
    if _dumps(records) != raw:
        raise UnsafeBundleError(f"{at}.files is not in canonical form")
    return out


CHUNK = 1 << 20  # every object and file is streamed in pieces of this size: memory stays O(CHUNK)
MAX_INDEX_BYTES = 256 << 20  # an index of 100k entries of 8 files is ~110 MB; nothing larger is read
MAX_SIGNATURE_BYTES = 64 << 10  # a signature file is ~200 bytes; nothing larger is read
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
    """All of ``f``, refusing more than ``limit`` bytes (an index, a signature, a receipt). A local file is read in
    one piece of its size: an index of 100 MB is not held twice while its pieces are joined."""
    with f:
        reader = _Reader(f, limit, lambda: IntegrityError(f"{where}: larger than {limit} bytes"))
        try:
            size = os.fstat(f.fileno()).st_size
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            size = 0
        first = reader.read(min(size, limit) + 1) if size else b""
        rest = b"".join(iter(reader.read, b""))  # a file that grew, or a stream of unknown size
        return first + rest if rest else first


def unpack_object(stream, entry: Entry, dest: str, final_dir: str, where: str,
                  files: tuple[FileRecord, ...] | None = None, groups: bool = True) -> int:
    """Check one object against its entry (``files``: its records, already read) while writing its files into a
    fresh ``dest`` dir; returns the object's size.

    One pass, O(CHUNK) memory: the object is read up to ``object_size`` (its sha256 must be its name), decompressed
    up to ``tar_size`` (an object cannot expand beyond what the index declares), parsed as a stream of members, each
    a plain regular file without setuid/setgid/sticky bits at a safe path, listed in the index, of the listed size
    and sha256; the members are exactly the listed files. Group files (``groups``: Triton's) must be in relative
    form and are written pointing at ``final_dir`` (where the entry will live). Files are created with
    O_EXCL|O_NOFOLLOW. An object of at most CHUNK bytes both ways (most of a Triton cache) is read, hashed and
    decompressed whole first, and its members written by the C member loop (prewarm/_fastunpack.c, where it is
    built), which hands anything but the plain form pack writes to the Python reader; a larger one is streamed
    through the Python reader. Any failure leaves a partial ``dest``: the caller stages into a dir it removes. A
    corrupted object is reported as such (its hash) rather than by whatever its corruption broke first.
    """
    where = f"{where} (entry {entry.key})"
    obj = f"object {entry.object}"
    files = entry.files if files is None else files
    raw = _Reader(stream, entry.object_size,
                  lambda: IntegrityError(f"{where}: {obj} is larger than the {entry.object_size} bytes the index lists"))

    def bomb() -> UnsafeBundleError:
        return UnsafeBundleError(f"{where}: {obj} decompresses to more than {entry.tar_size} bytes, the index declares "
                                 f"{entry.tar_size}")

    if entry.object_size <= CHUNK and entry.tar_size <= CHUNK:
        data = raw.read(entry.object_size + 1)  # a local file: one read of its size
        if rest := b"".join(iter(raw.read, b"")):  # a stream that came in pieces
            data += rest
        _check_object_hash(raw, entry, where, obj)  # every byte proven before one is parsed
        try:
            tar = _decompressor().stream_reader(data).read(entry.tar_size + 1)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"{where}: {obj} is not a valid zstd frame ({e})") from None
        if len(tar) > entry.tar_size:
            raise bomb()
        if _fastunpack is None or len(tar) != entry.tar_size or not _write_plain(tar, entry, files, dest, final_dir,
                                                                                   where, groups):
            _unpack_tar(_View(tar).read, entry, files, dest, final_dir, where, obj, groups)
        return raw.n
    tar_stream = _Reader(_decompressor().stream_reader(raw, read_size=CHUNK, closefd=False),
                         entry.tar_size, bomb)
    try:
        _unpack_tar(tar_stream.read, entry, files, dest, final_dir, where, obj, groups)
        raw.drain()
    except (PrewarmError, zstandard.ZstdError) as e:
        _check_object_hash(raw, entry, where, obj)  # corruption first: it explains whatever broke
        if isinstance(e, PrewarmError):
            raise
        raise IntegrityError(f"{where}: {obj} is not a valid zstd frame ({e})") from None
    _check_object_hash(raw, entry, where, obj)
    return raw.n


_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor, reused object after object (each stream resets it): a new one per object costs
    more than decompressing a small object."""
    if (d := getattr(_local, "dctx", None)) is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


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


# The tar reader: exactly what pack_entry writes (POSIX ustar headers, a pax 'x' header only to carry a long or
# non-ASCII path, NUL padding, two zero blocks then zeros up to tar_size), parsed field by field: tarfile costs ~40
# us per member, most of a 100,000-entry install. The header checksum is not read: the object's sha256, checked
# before (small objects) or alongside (streamed ones) parsing, already proves every byte.

_BLOCK = 512
_ZEROS = bytes(_BLOCK)
_OCTAL = re.compile(rb"([0-7]{1,12})[\x00 ]*")
_KINDS = {b"1": "hardlink", b"2": "symlink", b"3": "device", b"4": "device", b"5": "dir", b"6": "fifo",
          b"7": "contiguous file", b"g": "global pax header", b"L": "GNU long name", b"K": "GNU long link",
          b"S": "sparse file"}


class _View:
    """An in-memory tar read as a stream, without copying: each read is a view of its bytes."""

    def __init__(self, data: bytes):
        self.view, self.pos = memoryview(data), 0

    def read(self, n: int = CHUNK) -> memoryview:
        view = self.view[self.pos:self.pos + n]
        self.pos += len(view)
        return view


def _read_exact(read, n: int) -> bytes | memoryview:
    data = read(n)
    while len(data) < n and (more := read(n - len(data))):  # a stream's short reads
        data = bytes(data) + more
    return data


def _octal(field: bytes, what: str, where: str) -> int:
    m = _OCTAL.fullmatch(field)
    if m is None:
        raise IntegrityError(f"{where}: tar header field {what} {field!r} is not octal: not an object pack wrote")
    return int(m[1], 8)


def _pax_path(data: bytes, where: str) -> str:
    """The path of a pax extended header ('<len> path=<utf-8>\\n' records): the only record pack writes."""
    path, pos = None, 0
    while pos < len(data):
        length, _, rest = data[pos:pos + 24].partition(b" ")
        record = data[pos:pos + int(length)] if length.isdigit() and int(length) > len(length) + 1 else b""
        key, sep, value = record[len(length) + 1:-1].partition(b"=")
        if not record.endswith(b"\n") or not sep or key != b"path":
            raise UnsafeBundleError(f"{where}: pax header record {data[pos:pos + 40]!r}: only 'path' is allowed")
        try:
            path = value.decode("utf-8")
        except UnicodeDecodeError:
            raise UnsafeBundleError(f"{where}: pax path {value[:80]!r} is not UTF-8") from None
        pos += len(record)
    return path


def _unpack_tar(read, entry: Entry, files: tuple[FileRecord, ...], dest: str, final_dir: str, where: str,
                obj: str, groups: bool) -> None:
    os.mkdir(dest, 0o755)
    dest_fd = os.open(dest, DIR_FLAGS)  # every member created relative to it: no path walked per file
    try:
        _unpack_members(read, entry, files, dest, dest_fd, final_dir, where, obj, groups)
    finally:
        os.close(dest_fd)


DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX


def _unpack_members(read, entry: Entry, files: tuple[FileRecord, ...], dest: str, dest_fd: int, final_dir: str,
                    where: str, obj: str, groups: bool) -> None:
    expected = {f.path: f for f in files}
    names = {p.rsplit("/", 1)[-1] for p in expected}
    seen: set[str] = set()
    offset, long_path = 0, None
    while True:
        header = bytes(_read_exact(read, _BLOCK))
        offset += len(header)
        if len(header) < _BLOCK:
            raise IntegrityError(f"{where}: {obj} ends without the tar end marker: truncated")
        if header == _ZEROS:
            break
        if header[257:265] != b"ustar\x0000":
            raise IntegrityError(f"{where}: {obj}: member {offset // _BLOCK} has no POSIX tar header")
        size, mode, kind = _octal(header[124:136], "size", where), _octal(header[100:108], "mode", where), header[156:157]
        if kind == b"x" and long_path is None:  # a pax header: the next member's long or non-ASCII path
            if offset + size > entry.tar_size or size > 1 << 16:
                raise UnsafeBundleError(f"{where}: {obj}: pax header of {size} bytes")
            long_path = _pax_path(bytes(_read_exact(read, size)), where)
            offset += size + _skip_padding(read, size, where, obj)
            continue
        name = header[:100].split(b"\0", 1)[0]
        prefix = header[345:500].split(b"\0", 1)[0]
        try:
            path = long_path if long_path is not None else (prefix + b"/" + name if prefix else name).decode("utf-8")
        except UnicodeDecodeError:
            raise UnsafeBundleError(f"{where}: member name {name!r} is not UTF-8") from None
        long_path = None
        if path not in expected:  # every listed path was checked with its record
            check_rel_path(path, f"{where}: member")
            raise UnsafeBundleError(f"{where}: member {path!r} is not listed in the index")
        if kind not in (b"0", b"\0"):  # not sparse/contiguous either
            raise UnsafeBundleError(f"{where}: member {path!r} is a {_KINDS.get(kind, f'type {kind!r}')}, only regular "
                                    f"files are allowed")
        if mode & _SPECIAL_BITS:
            raise UnsafeBundleError(f"{where}: member {path!r} has setuid/setgid/sticky mode {mode:o}")
        if path in seen:
            raise UnsafeBundleError(f"{where}: member {path!r} appears twice")
        seen.add(path)
        rec = expected[path]
        if offset + size > entry.tar_size:
            raise UnsafeBundleError(f"{where}: {obj} decompresses to more than {entry.tar_size} bytes, the index "
                                    f"declares {entry.tar_size} (member {path!r} alone is {size})")
        if size != rec.size:
            raise IntegrityError(f"{where}: {path} is {size} bytes, the index lists {rec.size}")
        if "/" in path:  # a dir of our own fresh one: created here, no link can be in the way
            os.makedirs(os.path.join(dest, os.path.dirname(path)), 0o755, exist_ok=True)
        sha = hashlib.sha256()
        fd = os.open(path, _CREATE, 0o755 if mode & 0o111 else 0o644, dir_fd=dest_fd)
        try:
            if groups and is_group(path):
                if size > MAX_GROUP_BYTES:
                    raise UnsafeBundleError(f"{where}: group {path} is {size} bytes (at most {MAX_GROUP_BYTES})")
                data = bytes(_member_data(read, size, where, obj, path))
                sha.update(data)
                _write_all(fd, _installed_group(data, entry, names, path, final_dir, where))
            else:
                left = size
                while left:
                    chunk = _member_data(read, min(left, CHUNK), where, obj, path)
                    sha.update(chunk)
                    _write_all(fd, chunk)
                    left -= len(chunk)
        finally:
            os.close(fd)
        if sha.hexdigest() != rec.sha256:
            raise IntegrityError(f"{where}: {path} has sha256 {sha.hexdigest()}, the index lists {rec.sha256}")
        offset += size + _skip_padding(read, size, where, obj)
    if long_path is not None:
        raise UnsafeBundleError(f"{where}: {obj}: a pax header names no member")
    while rest := bytes(read(CHUNK)):  # the second end block and the record padding, up to exactly tar_size
        offset += len(rest)
        if rest.count(0) != len(rest):
            raise UnsafeBundleError(f"{where}: {obj} holds data after the tar end marker")
    if offset != entry.tar_size:
        raise UnsafeBundleError(f"{where}: {obj} decompresses to {offset} bytes, the index declares {entry.tar_size}")
    if missing := sorted(set(expected) - seen):
        raise IntegrityError(f"{where}: {obj} lacks {', '.join(missing)}")


def _installed_group(data: bytes, entry: Entry, names: set[str], path: str, final_dir: str, where: str) -> bytes:
    """A group file as it is written: checked to be in relative form and inside its entry, pointing at ``final_dir``."""
    rel, outside = relative_group(data, entry.key, names, f"{where}: {path}")
    if outside or rel != data:
        why = f"points outside its entry: {', '.join(outside)}" if outside else "is not in relative form"
        raise UnsafeBundleError(f"{where}: group {path} {why}")
    return absolute_group(data, final_dir)


def _write_plain(tar: bytes, entry: Entry, files: tuple[FileRecord, ...], dest: str, final_dir: str,
                 where: str, groups: bool) -> bool:
    """The C member loop (prewarm/_fastunpack.c) for an object whose every byte is proven, group files here. False,
    with ``dest`` removed again, where the object is not the plain form pack writes or a file is not as listed: the
    Python reader then reads it again and says what is wrong."""
    listed = {f.path.encode(): (i, f.size, bytes.fromhex(f.sha256), groups and is_group(f.path))
              for i, f in enumerate(files)}
    os.mkdir(dest, 0o755)
    dest_fd = os.open(dest, DIR_FLAGS)
    try:
        try:
            groups = _fastunpack.write_members(tar, dest_fd, listed)
        except OSError as e:  # named by its file in dest, as the Python reader's errors are by dest
            e.filename = os.path.join(dest, e.filename)
            raise
        names = {f.path.rsplit("/", 1)[-1] for f in files}
        for name, start, size, executable in groups or ():
            data, path = tar[start:start + size], name.decode()
            if size > MAX_GROUP_BYTES or hashlib.sha256(data).digest() != listed[name][2]:
                groups = None
                break
            installed = _installed_group(data, entry, names, path, final_dir, where)
            fd = os.open(path, _CREATE, 0o755 if executable else 0o644, dir_fd=dest_fd)
            try:
                _write_all(fd, installed)
            finally:
                os.close(fd)
    finally:
        os.close(dest_fd)
    if groups is None:
        shutil.rmtree(dest)
        return False
    return True


def _member_data(read, n: int, where: str, obj: str, path: str) -> bytes:
    data = _read_exact(read, n)
    if len(data) < n:
        raise IntegrityError(f"{where}: {obj} ends inside member {path}: truncated")
    return data


def _skip_padding(read, size: int, where: str, obj: str) -> int:
    pad = -size % _BLOCK
    if pad and _read_exact(read, pad) != _ZEROS[:pad]:
        raise IntegrityError(f"{where}: {obj}: tar padding is not zeros (or the object is truncated)")
    return pad


def _write_all(fd: int, data: bytes) -> None:
    with memoryview(data) as view:
        while view:
            view = view[os.write(fd, view):]
