"""pack: a real Triton cache -> a deterministic, relocatable, content-addressed bundle."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile

import zstandard

from prewarm import __version__
from prewarm.shipping.bundle import INDEX, OBJECTS, SIGNATURE, parse_index
from prewarm.shipping.cachedir import META, CacheDir
from prewarm.shipping.install import install
from prewarm.shipping.pack import pack
from prewarm.node.verify import verify

from prewarm_helpers import build_toy_cache, run_cli


def _members(obj: bytes) -> list[tarfile.TarInfo]:
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(obj)).read()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar]


def test_pack_is_deterministic_and_content_addressed(triton_cache, tmp_path):
    a = pack(triton_cache, tmp_path / "a")
    b = pack(triton_cache, tmp_path / "b")
    assert (tmp_path / "a" / INDEX).read_bytes() == (tmp_path / "b" / INDEX).read_bytes()
    names = sorted(p.name for p in (tmp_path / "a" / OBJECTS).iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b" / OBJECTS).iterdir())
    assert len(names) == len(a.index.entries) == 5 and a.objects_written == 5
    for n in names:
        assert hashlib.sha256((tmp_path / "a" / OBJECTS / n).read_bytes()).hexdigest() + ".tar.zst" == n
    again = pack(triton_cache, tmp_path / "a")  # repacking into the same bundle rewrites nothing
    assert again.objects_written == 0 and again.index.digest == b.index.digest


def test_index_lists_every_file_with_hash_and_the_environment(triton_cache, tmp_path):
    r = pack(triton_cache, tmp_path / "b")
    index = parse_index((tmp_path / "b" / INDEX).read_bytes(), "test")
    assert index.tool == f"prewarm {__version__}" and index.manifest is None
    for factor in ("triton.distribution", "triton.version", "triton.key", "python.abi", "target.backend",
                   "target.arch", "cuda.ptxas", "torch.version"):
        assert factor in index.fingerprint
    on_disk = sorted(p.relative_to(triton_cache).as_posix() for p in triton_cache.rglob("*") if p.is_file())
    listed = sorted(f"{e.key}/{f.path}" for e in index.entries for f in e.files)
    assert listed == on_disk
    for e in index.entries:
        for f in e.files:
            if not f.path.startswith("__grp__"):
                data = (triton_cache / e.key / f.path).read_bytes()
                assert (f.sha256, f.size) == (hashlib.sha256(data).hexdigest(), len(data))
    assert r.bytes_in == sum(f.size for e in index.entries for f in e.files)


def test_objects_hold_relative_paths_only_and_normalized_metadata(triton_cache, tmp_path):
    pack(triton_cache, tmp_path / "b")
    everything = (tmp_path / "b" / INDEX).read_bytes()
    for obj in (tmp_path / "b" / OBJECTS).iterdir():
        for m, data in _members(obj.read_bytes()):
            assert not m.name.startswith("/") and ".." not in m.name.split("/")
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
            assert m.mode in (0o644, 0o755) and m.isreg()
            everything += data
            if m.name.startswith("__grp__"):
                children = json.loads(data)["child_paths"]
                assert children and all("/" not in p for p in children.values())
    assert str(triton_cache).encode() not in everything  # no path of the build box survives


def test_build_info_supplies_fingerprint_and_manifest_digest(triton_cache, tmp_path):
    fp = {"triton.version": "3.6.0", "target.backend": "cuda", "target.arch": "sm_90"}
    CacheDir(triton_cache).write_build_info({"manifest": {"name": "kda-k3", "digest": "ab" * 32}, "fingerprint": fp})
    r = pack(triton_cache, tmp_path / "b")
    assert r.index.fingerprint == fp and r.index.manifest == {"name": "kda-k3", "digest": "ab" * 32}
    assert META not in {e.key for e in r.index.entries}


def test_signed_pack_writes_signature_and_unsigned_repack_removes_stale_one(triton_cache, tmp_path):
    run_cli("keygen", "-o", tmp_path / "k")
    run_cli("pack", triton_cache, "-o", tmp_path / "b", "--sign", tmp_path / "k.key")
    assert json.loads((tmp_path / "b" / SIGNATURE).read_text())["alg"] == "ed25519"
    pack(triton_cache, tmp_path / "b")
    assert not (tmp_path / "b" / SIGNATURE).exists()


def test_relocation_build_in_x_install_in_y_delete_x_triton_finds_every_child(tmp_path, monkeypatch):
    x, y = tmp_path / "x", tmp_path / "y"
    build_toy_cache(x)
    groups_before = {g.relative_to(x).as_posix(): json.loads(g.read_text()) for g in x.glob("*/__grp__*.json")}
    assert groups_before and all(str(x) in p for g in groups_before.values() for p in g["child_paths"].values())
    pack(x, tmp_path / "bundle")
    shutil.rmtree(x)
    install(str(tmp_path / "bundle"), y)
    assert verify(y).ok

    monkeypatch.setenv("TRITON_CACHE_DIR", str(y))
    from triton.runtime.cache import FileCacheManager

    for rel, before in groups_before.items():
        key, grp = rel.split("/")
        doc = json.loads((y / rel).read_text())
        assert all(p.startswith(f"{y}/{key}/") for p in doc["child_paths"].values())
        found = FileCacheManager(key).get_group(grp[len("__grp__"):])
        assert set(found) == set(before["child_paths"])  # nothing dropped: Triton would not recompile
        assert all(p.startswith(str(y)) for p in found.values())
