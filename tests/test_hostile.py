"""Hostile bundles are refused with a clear error, and nothing is written (the previous cache stays as it was)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import zstandard

from prewarm.shipping import bundle as bundle_module
from prewarm.node import fingerprint
from prewarm.shipping.bundle import INDEX, OBJECTS, SIGNATURE, Entry, FileRecord, Index, _with_checksum, parse_index
from prewarm.shipping.cachedir import META, CacheDir
from prewarm.errors import IntegrityError, SignatureError, UnsafeBundleError
from prewarm.shipping.install import install
from prewarm.shipping.pack import pack
from prewarm.node.verify import verify

from prewarm_helpers import run_cli, synthetic_cache

KEY = "A" * 52


def member(name: str, data: bytes = b"", *, type=tarfile.REGTYPE, mode=0o644, linkname="") -> tuple:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.size, ti.linkname = type, mode, len(data) if type == tarfile.REGTYPE else 0, linkname
    return ti, data


def forge(bundle: Path, members: list[tuple], *, files: list[FileRecord] | None = None, key: str = KEY,
          tar_size: int | None = None, edit=lambda raw: raw) -> Path:
    """A well-formed bundle (valid hashes, valid checksum) around whatever members an attacker chose (and whatever
    ``edit`` makes of the tar they form)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if ti.type == tarfile.REGTYPE else None)
    raw = edit(buf.getvalue())
    obj = zstandard.ZstdCompressor().compress(raw)
    name = hashlib.sha256(obj).hexdigest() + ".tar.zst"
    (bundle / OBJECTS).mkdir(parents=True, exist_ok=True)
    (bundle / OBJECTS / name).write_bytes(obj)
    if files is None:
        files = [FileRecord(ti.name, hashlib.sha256(d).hexdigest(), len(d)) for ti, d in members]
    entry = Entry(key, name, len(obj), len(raw) if tar_size is None else tar_size, tuple(files))
    (bundle / INDEX).write_bytes(Index(fingerprint.current(), None, (entry,)).to_bytes())
    return bundle


def snapshot(cache: Path) -> dict[str, bytes]:
    return {p.relative_to(cache).as_posix(): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()
            and META not in p.relative_to(cache).parts}


@pytest.fixture
def node(tmp_path) -> Path:
    """A cache with a previous state that every refusal must leave exactly as it was."""
    return synthetic_cache(tmp_path / "node", 2, seed=42, scale=0.02)


@pytest.fixture(params=["C member loop", "Python reader"])
def reader(request, monkeypatch) -> str:
    """Each object-level case twice: through install's C member loop (prewarm/_fastunpack.c), which must hand every
    object that is not the plain form pack writes to the Python reader, and through the Python reader alone (where
    prewarm was installed without a C compiler)."""
    if request.param == "Python reader":
        monkeypatch.setattr(bundle_module, "_fastunpack", None)
    else:
        assert bundle_module._fastunpack is not None, "prewarm/_fastunpack.c is not built: run pip install -e ."
    return request.param


def refused(bundle: Path, node: Path, error: type, match: str) -> None:
    before = snapshot(node)
    with pytest.raises(error, match=match):
        install(str(bundle), node)
    assert snapshot(node) == before
    assert not CacheDir(node).staging_dirs() and not CacheDir(node).receipts()
    assert not (node / KEY).exists()


@pytest.mark.parametrize("path", ["/etc/cron.d/evil", "../../evil.so", "a/../../evil", "", "a//b", "./x"])
def test_absolute_and_escaping_paths_in_index(tmp_path, node, path):
    forge(tmp_path / "b", [member("k.json", b"{}")], files=[FileRecord(path, "0" * 64, 0)])
    refused(tmp_path / "b", node, UnsafeBundleError, "unsafe path")


@pytest.mark.parametrize("path", ["/etc/cron.d/evil", "../evil"])
def test_escaping_member_names_in_object(tmp_path, node, reader, path):
    forge(tmp_path / "b", [member(path, b"x")], files=[FileRecord("k.json", hashlib.sha256(b"x").hexdigest(), 1)])
    refused(tmp_path / "b", node, UnsafeBundleError, "unsafe path")


@pytest.mark.parametrize("key", ["..", ".prewarm", "../up", "a/b", "x" * 200])
def test_escaping_entry_keys(tmp_path, node, key):
    forge(tmp_path / "b", [member("k.json", b"{}")], key=key)
    refused(tmp_path / "b", node, UnsafeBundleError, "key")


@pytest.mark.parametrize(
    "m, what",
    [
        (member("k.cubin", type=tarfile.SYMTYPE, linkname="/etc/passwd"), "symlink"),
        (member("k.cubin", type=tarfile.LNKTYPE, linkname="k.json"), "hardlink"),
        (member("k.cubin", type=tarfile.CHRTYPE), "device"),
        (member("k.cubin", type=tarfile.FIFOTYPE), "fifo"),
        (member("k.cubin", b"\x7fELF", mode=0o4755), "setuid"),
        (member("k.cubin", b"\x7fELF", mode=0o2755), "setgid"),
    ],
)
def test_links_devices_and_setuid_bits(tmp_path, node, reader, m, what):
    forge(tmp_path / "b", [member("k.json", b"{}"), m], files=[
        FileRecord("k.json", hashlib.sha256(b"{}").hexdigest(), 2), FileRecord("k.cubin", hashlib.sha256(b"").hexdigest(), 0)])
    refused(tmp_path / "b", node, UnsafeBundleError, what)


def test_member_not_listed_in_index(tmp_path, node, reader):
    forge(tmp_path / "b", [member("k.json", b"{}"), member("extra.so", b"\x7fELF")],
          files=[FileRecord("k.json", hashlib.sha256(b"{}").hexdigest(), 2)])
    refused(tmp_path / "b", node, UnsafeBundleError, "not listed")


def test_object_decompressing_far_beyond_declared_size(tmp_path, node):
    bomb = bytes(64 << 20)  # 64 MiB of zeros: ~2 KiB compressed
    forge(tmp_path / "b", [member("k.cubin", bomb)], files=[FileRecord("k.cubin", "0" * 64, 100)], tar_size=4096)
    assert (tmp_path / "b" / OBJECTS).stat().st_size < 1 << 20
    refused(tmp_path / "b", node, UnsafeBundleError, "decompresses to more than 4096 bytes")


def test_group_in_bundle_pointing_outside(tmp_path, node, reader):
    grp = b'{"child_paths": {"k.cubin": "/etc/passwd"}}'
    forge(tmp_path / "b", [member("__grp__k.json", grp), member("k.cubin", b"\x7fELF")])
    refused(tmp_path / "b", node, UnsafeBundleError, "points outside")


def test_index_referencing_a_missing_object(triton_cache, tmp_path, node):
    pack(triton_cache, tmp_path / "b")
    gone = sorted((tmp_path / "b" / OBJECTS).iterdir())[2]
    gone.unlink()
    before = snapshot(node)
    with pytest.raises(IntegrityError, match=f"{gone.name}.*missing"):
        install(str(tmp_path / "b"), node)
    assert snapshot(node) == before  # the other four entries were not added either


def test_garbage_signature_is_refused(triton_cache, tmp_path, node):
    from prewarm.shipping.signing import keygen

    _, pub, _ = keygen(tmp_path / "k")
    pack(triton_cache, tmp_path / "b")
    (tmp_path / "b" / SIGNATURE).write_text('{"alg": "ed25519", "key_id": "x", "signature": "AAAA"}')
    before = snapshot(node)
    with pytest.raises(SignatureError):
        install(str(tmp_path / "b"), node, trusted_keys=[str(pub)])
    assert snapshot(node) == before


def test_flipping_any_byte_of_the_index_is_caught(triton_cache, tmp_path, node):
    pack(triton_cache, tmp_path / "b")
    data = (tmp_path / "b" / INDEX).read_bytes()
    for i in range(len(data)):  # every single position
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises((IntegrityError, UnsafeBundleError)):
            parse_index(bytes(bad), "index.json")
    for i in random.Random(1).sample(range(len(data)), 3):  # and end to end, through install
        bad = bytearray(data)
        bad[i] ^= 0x20
        (tmp_path / "b" / INDEX).write_bytes(bytes(bad))
        before = snapshot(node)
        with pytest.raises(IntegrityError, match=r"index\.json"):
            install(str(tmp_path / "b"), node)
        assert snapshot(node) == before


def test_flipping_one_byte_of_any_object_names_it(triton_cache, tmp_path, node):
    pack(triton_cache, tmp_path / "b")
    rng = random.Random(2)
    for obj in sorted((tmp_path / "b" / OBJECTS).iterdir()):
        good = obj.read_bytes()
        bad = bytearray(good)
        bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        obj.write_bytes(bytes(bad))
        before = snapshot(node)
        with pytest.raises(IntegrityError, match=obj.name):
            install(str(tmp_path / "b"), node)
        assert snapshot(node) == before
        obj.write_bytes(good)


def test_nothing_from_the_bundle_is_executed(tmp_path, node):
    """A launcher .so whose constructor would leave a marker: install and verify must never load it."""
    marker = tmp_path / "executed"
    src = tmp_path / "evil.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void f(void) {{ fopen("{marker}", "w"); }}\n')
    so = tmp_path / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    cache = tmp_path / "src-cache"
    (cache / KEY).mkdir(parents=True)
    (cache / KEY / "__triton_launcher.so").write_bytes(so.read_bytes())
    os.chmod(cache / KEY / "__triton_launcher.so", 0o755)
    pack(cache, tmp_path / "b")
    r = install(str(tmp_path / "b"), node)
    assert r.installed == 1 and verify(node).ok
    assert os.stat(node / KEY / "__triton_launcher.so").st_mode & 0o777 == 0o755
    assert not marker.exists()


# --- issue 13: per-file hashes, bounded reads, and no traceback for any input ------------------------------------


def test_a_file_whose_bytes_disagree_with_the_index_hash_is_refused_while_unpacking(tmp_path, node, reader):
    """A well-formed object (its own sha256 right) whose member is not the file the index lists."""
    forge(tmp_path / "b", [member("k.cubin", b"\x7fELF evil")],
          files=[FileRecord("k.cubin", hashlib.sha256(b"\x7fELF good").hexdigest(), 9)])
    refused(tmp_path / "b", node, IntegrityError, r"k\.cubin has sha256 .*, the index lists")


def test_a_bad_file_after_good_ones_leaves_nothing_staged(tmp_path, node, reader):
    """The C loop writes each file once its size and sha256 are proven, then meets one that is not as listed: the
    entry's staging dir goes, and the refusal is the Python reader's."""
    files = [FileRecord("a.ptx", hashlib.sha256(b"ptx").hexdigest(), 3),
             FileRecord("b.cubin", hashlib.sha256(b"\x7fELF good").hexdigest(), 9)]
    forge(tmp_path / "b", [member("a.ptx", b"ptx"), member("b.cubin", b"\x7fELF evil")], files=files)
    refused(tmp_path / "b", node, IntegrityError, r"b\.cubin has sha256 .*, the index lists")


@pytest.mark.parametrize("edit, error, match", [
    (lambda raw: raw + b"\x01", UnsafeBundleError, "holds data after the tar end marker"),
    (lambda raw: raw[:1024], IntegrityError, "ends without the tar end marker: truncated"),
    (lambda raw: raw[:600] + b"\x01" + raw[601:], IntegrityError, "tar padding is not zeros"),
    (lambda raw: raw[:257] + b"gnu   " + raw[263:], IntegrityError, "has no POSIX tar header"),
    (lambda raw: raw[:124] + b"0000000000x\0" + raw[136:], IntegrityError, "field size .* is not octal"),
], ids=["data after the end", "truncated", "padding not zeros", "not ustar", "size not octal"])
def test_a_tar_not_as_pack_writes_it_is_refused(tmp_path, node, reader, edit, error, match):
    forge(tmp_path / "b", [member("k.cubin", b"\x7fELF")], edit=edit)
    refused(tmp_path / "b", node, error, match)


def test_the_forms_pack_does_not_write_that_are_still_valid_install_alike(tmp_path, reader):
    """A long name (a pax header), a file in a subdir, executable bits: outside the C loop's plain form, so the Python
    reader writes them, the same files either way."""
    long = "k" * 150 + ".cubin"
    members = [member(long, b"\x7fELF 1"), member("sub/k.ptx", b"ptx"), member("run.sh", b"#!", mode=0o755),
               member("__grp__k.json", json.dumps({"child_paths": {"k.cubin": long}}).encode())]
    forge(tmp_path / "b", members)
    install(str(tmp_path / "b"), tmp_path / "node")
    entry = tmp_path / "node" / KEY
    assert {p.relative_to(entry).as_posix(): p.read_bytes() for p in entry.rglob("*") if p.is_file()} == {
        long: b"\x7fELF 1", "sub/k.ptx": b"ptx", "run.sh": b"#!",
        "__grp__k.json": json.dumps({"child_paths": {"k.cubin": str(entry / long)}}).encode()}
    assert os.stat(entry / "run.sh").st_mode & 0o777 == 0o755 and os.stat(entry / long).st_mode & 0o777 == 0o644


def _listing(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def hostile_cli(tmp_path: Path, node: Path, args: list, code: int, message: str, env: dict | None = None) -> None:
    """The real CLI: the documented exit code and message, no traceback, the node's cache intact, nothing written
    outside it (prewarm's own .prewarm dir inside it may gain its lock)."""
    before, outside = snapshot(node), _listing(tmp_path)
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert (p.returncode, "Traceback" in p.stderr) == (code, False), p.stderr
    assert re.search(message, " ".join(p.stderr.split())), p.stderr
    assert snapshot(node) == before and not (node / KEY).exists()
    assert {x for x in _listing(tmp_path) - outside if not x.startswith(f"{node.name}/{META}")} == set()


def _forged_index(bundle: Path, doc: dict) -> Path:
    (bundle / OBJECTS).mkdir(parents=True, exist_ok=True)
    (bundle / INDEX).write_bytes(_with_checksum(doc))
    return bundle


def _fp_doc() -> dict:
    return {"format": 1, "tool": "prewarm 0.1.0", "fingerprint": fingerprint.current(), "manifest": None}


def _ok_member() -> tuple:
    return member("k.cubin", b"\x7fELF")


HOSTILE_BUNDLES = {
    # name: (make the bundle under tmp_path/"b", expected exit code, message)
    "file/dir collision": (lambda b: forge(b, [member("a", b"1"), member("a/b", b"2")]), 9,
                           "listed as a file and as a directory"),
    "name over 255 bytes": (lambda b: forge(b, [member("x" * 300, b"1")]), 9, "name over 255 bytes"),
    "lone surrogate": (lambda b: forge(b, [_ok_member()], files=[FileRecord("k\ud800.cubin", "0" * 64, 4)]), 9,
                       "lone surrogate"),
    "declared size 2^40": (lambda b: forge(b, [_ok_member()], files=[FileRecord("k.cubin", "0" * 64, 2**40)],
                                           tar_size=2**40), 6, "is 4 bytes, the index lists 1099511627776"),
    "deeply nested JSON": (lambda b: (b.mkdir(), (b / INDEX).write_bytes(b"[" * 200_000 + b"]" * 200_000)), 6,
                           "not a prewarm index"),
    "entries not a list": (lambda b: _forged_index(b, {**_fp_doc(), "entries": 5}), 9, "entries is not a list"),
    "files not a list": (lambda b: _forged_index(b, {**_fp_doc(), "entries": [
        {"key": KEY, "object": "0" * 64 + ".tar.zst", "object_size": 1, "tar_size": 1, "files": 7}]}), 9,
        "files is not a list"),
    "file record not an object": (lambda b: _forged_index(b, {**_fp_doc(), "entries": [
        {"key": KEY, "object": "0" * 64 + ".tar.zst", "object_size": 1, "tar_size": 1, "files": [[1, 2]]}]}), 9,
        "file record"),
    "fingerprint a list": (lambda b: _forged_index(b, {**_fp_doc(), "fingerprint": [], "entries": []}), 9,
                           "malformed index: fingerprint"),
    "objects is a file": (lambda b: (forge(b, [_ok_member()]), shutil.rmtree(b / OBJECTS),
                                     (b / OBJECTS).write_text("x")), 6, "missing from the bundle"),
    # a dir, FIFO or device where a store's blob should be: the store's fault (exit 10), as other store faults
    "index is a directory": (lambda b: (forge(b, [_ok_member()]), (b / INDEX).unlink(), (b / INDEX).mkdir()), 10,
                             "index.json: not a regular file"),
    "index is a FIFO": (lambda b: (forge(b, [_ok_member()]), (b / INDEX).unlink(), os.mkfifo(b / INDEX)), 10,
                        "index.json: not a regular file"),
    "object is a FIFO": (lambda b: _replace_object(b, os.mkfifo), 10, "not a regular file"),
    "object links to /dev/zero": (lambda b: _replace_object(b, lambda p: p.symlink_to("/dev/zero")), 10,
                                  "not a regular file"),
    "object is a 2 GiB sparse file": (lambda b: _replace_object(b, lambda p: os.truncate(
        os.open(p, os.O_CREAT | os.O_WRONLY), 2 << 30)), 6, "larger than the \\d+ bytes the index lists"),
}


def _replace_object(bundle: Path, make) -> None:
    forge(bundle, [_ok_member()])
    (obj,) = (bundle / OBJECTS).iterdir()
    obj.unlink()
    make(obj)


@pytest.mark.parametrize("case", sorted(HOSTILE_BUNDLES))
def test_no_traceback_for_any_bundle_input(tmp_path, node, case):
    make, code, message = HOSTILE_BUNDLES[case]
    make(tmp_path / "b")
    hostile_cli(tmp_path, node, ["install", tmp_path / "b", "--cache-dir", node, "--lock-timeout", "5"], code, message)


def test_a_signature_naming_a_non_string_key_id_is_a_signature_error(triton_cache, tmp_path, node):
    from prewarm.shipping.signing import keygen

    _, pub, _ = keygen(tmp_path / "k")
    pack(triton_cache, tmp_path / "b")
    (tmp_path / "b" / SIGNATURE).write_text('{"alg": "ed25519", "key_id": [1], "signature": "AAAA"}')
    hostile_cli(tmp_path, node, ["install", tmp_path / "b", "--cache-dir", node, "--trust", pub], 7, "names no key id")


@pytest.mark.parametrize("where", ["cache dir", ".prewarm"])
def test_a_cache_dir_or_its_prewarm_dir_being_a_file(triton_cache, tmp_path, where):
    pack(triton_cache, tmp_path / "b")
    cache = tmp_path / "cache"
    if where == "cache dir":
        cache.write_text("not a dir")
    else:
        cache.mkdir()
        (cache / META).write_text("not a dir")
    p = run_cli("install", tmp_path / "b", "--cache-dir", cache, check=11)
    assert "exists and is not a directory" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("verify", "--cache-dir", cache, check=6)
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("args", [["install", "x", "--workers", "-1"], ["install", "x", "--lock-timeout", "-1"],
                                  ["install", "x", "--lock-timeout", "nan"], ["push", "x", "--retries", "-1"],
                                  ["build", "m.toml", "--cache-dir", "d", "--workers", "0"]])
def test_negative_or_absurd_numbers_are_refused_by_the_command_line(args):
    p = run_cli(*args, check=2)
    assert "out of range" in p.stderr and "Traceback" not in p.stderr


# --- issue 28: an index as strict as Triton's own keys ----------------------------------------------------------

def _entry_doc(key: str = KEY, **changes) -> dict:
    doc = {"key": key, "object": "0" * 64 + ".tar.zst", "object_size": 1, "tar_size": 1024,
           "files": [{"path": "k.cubin", "sha256": "0" * 64, "size": 4}]}
    return {**doc, **changes}


def _index_doc(*entries: dict, **top) -> dict:
    return {**_fp_doc(), "entries": list(entries), **top}


def test_a_key_ending_in_a_newline_is_refused_naming_the_entry_and_field(tmp_path, node):
    """Before: accepted, and the cache got a dir whose name ends in a newline (no Triton key looks like that)."""
    _forged_index(tmp_path / "b", _index_doc(_entry_doc("ESCAPEKEYNL\n")))
    hostile_cli(tmp_path, node, ["install", tmp_path / "b", "--cache-dir", node], 9,
                r"entries\[0\]\.key 'ESCAPEKEYNL\\n' is not a cache key of triton 3\.\d+\.\d+ \(base32 of a sha256")
    assert not [p for p in node.iterdir() if p.name.endswith("\n")]


def test_format_true_is_not_format_1(tmp_path, node):
    """Before: a JSON bool was taken for the integer 1."""
    _forged_index(tmp_path / "b", _index_doc(_entry_doc(), format=True))
    hostile_cli(tmp_path, node, ["install", tmp_path / "b", "--cache-dir", node], 9,
                r"malformed index: format True: this prewarm reads format 1 \(an integer\)")


B32 = "A" * 51 + "Q"  # base32 of a sha256: 52 characters, the last one holding one bit
B64 = "A" * 42 + "w"  # urlsafe base64 of a sha256 (triton 3.2): 43 characters
B64_MD5 = "fMYIAddf6WjySrKWEsFWzg"  # triton-ascend 3.2's npu_utils dir: urlsafe base64 of an md5


@pytest.mark.parametrize("doc, what", [
    (_index_doc(_entry_doc(object_size=True)), r"entries\[0\]\.object_size True is not an integer >= 0"),
    (_index_doc(_entry_doc(tar_size=1024.0)), r"entries\[0\]\.tar_size 1024\.0 is not an integer >= 0"),
    (_index_doc(_entry_doc(tar_size=-1)), r"entries\[0\]\.tar_size -1 is not an integer >= 0"),
    (_index_doc(_entry_doc(object=5)), r"entries\[0\]\.object 5 is not <sha256>\.tar\.zst"),
    (_index_doc(_entry_doc(files={"k.cubin": 4})), r"entries\[0\]\.files is not a list"),
    (_index_doc(_entry_doc(extra=1)), r"entries\[0\] has fields \[.*'extra'.*\]"),
    (_index_doc(_entry_doc(), _entry_doc(key=KEY)), r"entries\[1\]\.key 'A{52}' repeated"),
    (_index_doc(_entry_doc(files=[{"path": "k.cubin", "sha256": "0" * 64, "size": True}])),
     r"entries\[0\]\.files\[0\]: file record .* is not"),
    (_index_doc(_entry_doc(files=[{"path": "k.cubin", "sha256": "0" * 64, "size": "4"}])),
     r"entries\[0\]\.files\[0\]: file record"),
    (_index_doc(_entry_doc(files=[{"path": "k.cubin", "sha256": "A" * 64, "size": 4}])),
     r"entries\[0\]\.files\[0\]\.sha256 'A{64}' is not a sha256"),
    (_index_doc(_entry_doc(files=[{"path": "k.cubin", "sha256": "0" * 64, "size": 4, "mode": 493}])),
     r"entries\[0\]\.files\[0\]: file record"),
    (_index_doc(tool=5), r"tool 5 is not a string"),
    (_index_doc(fingerprint={"triton.version": 3.6}), r"fingerprint is not an object of strings"),
    (_index_doc(manifest={"name": "kda", "digest": 1}), r"manifest .* is neither null nor"),
    (_index_doc(manifest={"name": "kda"}), r"manifest .* is neither null nor"),
    (_index_doc(zzz=1), r"top-level fields \[.*'zzz'\]; format 1 has checksum, entries, fingerprint"),
    (_index_doc(extra=1), r"no fingerprint right after the entries; format 1 has checksum, entries, fingerprint"),
    ({"checksum": "", **_index_doc(), "entries": 5}, r"entries is not a list"),
    # keys: the form of the cache keys of the Triton the bundle names (this node's: triton 3.6, base32 of a sha256)
    (_index_doc(_entry_doc(B64)), r"entries\[0\]\.key '.*' is not a cache key of triton 3\.\d+\.\d+"),
    (_index_doc(_entry_doc("A" * 51)), r"is not a cache key"),  # one character short
    (_index_doc(_entry_doc("A" * 51 + "B")), r"is not a cache key"),  # no sha256 encodes to that last character
    (_index_doc(_entry_doc("a" * 52)), r"is not a cache key"),  # base32 is upper case
    (_index_doc(_entry_doc("A" * 25 + "Q")), r"is not a cache key"),  # an md5's form: npu_utils, Ascend only
    (_index_doc(_entry_doc("A" * 51 + "Q/")), r"is not a cache key"),
    (_index_doc(_entry_doc(7)), r"entries\[0\]\.key 7 is not a cache key"),
])
def test_every_field_has_exactly_its_type_and_every_key_the_form_of_a_triton_key(doc, what):
    with pytest.raises(UnsafeBundleError, match=what):
        parse_index(_with_checksum(doc), "index.json")


def test_a_file_list_in_another_spelling_than_the_canonical_one_is_refused():
    data = _with_checksum(_index_doc(_entry_doc()))
    spaced = data.replace(b'"sha256":"', b'"sha256": "')
    body = spaced[len(b'{"checksum":"') + 64 + 2:]
    resummed = b'{"checksum":"' + hashlib.sha256(b"{" + body).hexdigest().encode() + b'",' + body
    with pytest.raises(UnsafeBundleError, match=r"entries\[0\]\.files is not in canonical form"):
        parse_index(resummed, "index.json")


@pytest.mark.parametrize("dist, version, keys", [
    ("triton", "3.6.0", [B32, "7" * 51 + "A"]),  # kernels, launchers, cuda_utils, autotune results: all sha256
    ("triton-ascend", "3.2.0", [B64, B64_MD5]),  # 3.2: urlsafe base64; npu_utils: an md5
    ("triton-ascend", "3.5.0", [B32, "A" * 25 + "Y"]),  # 3.5: base32, an md5 too for npu_utils
])
def test_the_key_forms_each_triton_writes_are_accepted(dist, version, keys):
    fp = {"triton.distribution": dist, "triton.version": version}
    index = parse_index(_with_checksum(_index_doc(*map(_entry_doc, keys), fingerprint=fp)), "index.json")
    assert [e.key for e in index.entries] == keys


def test_the_key_form_follows_the_bundle_s_triton():
    fp = {"triton.distribution": "triton-ascend", "triton.version": "3.2.0"}
    with pytest.raises(UnsafeBundleError, match=r"not a cache key of triton-ascend 3\.2\.0 \(urlsafe base64"):
        parse_index(_with_checksum(_index_doc(_entry_doc(B32), fingerprint=fp)), "index.json")
    fp = {"triton.distribution": "triton", "triton.version": "3.6.0"}
    with pytest.raises(UnsafeBundleError, match="base32 of a sha256"):  # upstream: no md5 dirs (no npu_utils)
        parse_index(_with_checksum(_index_doc(_entry_doc("A" * 25 + "Y"), fingerprint=fp)), "index.json")


def test_a_triton_autotune_result_dir_packs_and_installs(tmp_path, node):
    """Triton keeps autotune results in key dirs of their own (<fn>.autotune.json under base32 of a sha256)."""
    entry = tmp_path / "cache" / B32
    entry.mkdir(parents=True)
    (entry / "chunk_kda_fwd.autotune.json").write_text('{"key": [4096], "configs_timings": [], "cache": {}}')
    pack(tmp_path / "cache", tmp_path / "b")
    assert install(str(tmp_path / "b"), node).installed == 1 and verify(node).ok


def test_pack_leaves_out_dirs_no_triton_would_look_up(tmp_path):
    """Packing what install would refuse would make a bundle no node can take: such dirs are reported skipped."""
    cache = synthetic_cache(tmp_path / "cache", 2, seed=4, scale=0.01)
    shutil.copytree(next(p for p in cache.iterdir() if p.is_dir()), cache / ("B" * 52))
    r = pack(cache, tmp_path / "b")
    assert len(r.index.entries) == 2 and "B" * 52 in r.skipped
