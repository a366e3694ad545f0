"""cachedir: the one owner of a cache dir's layout, of "is this entry intact", and of writing a file whole."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from prewarm.shipping.pack import pack
from prewarm.shipping.cachedir import META, CacheDir, write_atomic
from prewarm.shipping.install import install

from prewarm_helpers import synthetic_cache


def _leftovers(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_a_write_the_disk_refuses_midway_leaves_the_old_file_and_no_temp_file(tmp_path):
    """The kernel refuses the write past 4 KiB (RLIMIT_FSIZE: what a full disk does to a large file): the reader
    still sees the old file whole, and nothing else is left in the dir."""
    path = tmp_path / "index.json"
    path.write_bytes(b"old")
    script = textwrap.dedent(f"""
        import resource, signal
        from prewarm.shipping.cachedir import write_atomic
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            write_atomic({str(path)!r}, b"n" * 100_000)
        except OSError as e:
            print(e.errno)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert p.stdout.strip() == str(__import__("errno").EFBIG), p.stderr
    assert path.read_bytes() == b"old" and _leftovers(tmp_path) == []


def test_a_write_that_cannot_replace_its_target_leaves_no_temp_file(tmp_path):
    (tmp_path / "receipt.json").mkdir()
    (tmp_path / "receipt.json" / "x").write_text("a dir in the way")
    with pytest.raises(OSError):
        write_atomic(tmp_path / "receipt.json", b"{}")
    assert _leftovers(tmp_path) == [] and (tmp_path / "receipt.json" / "x").read_text() == "a dir in the way"


def test_a_written_file_is_whole_and_has_the_mode_asked_for(tmp_path):
    write_atomic(tmp_path / "k.key", b"secret", mode=0o600)
    write_atomic(tmp_path / "k.key", b"secret 2", mode=0o600, durable=False)
    assert (tmp_path / "k.key").read_bytes() == b"secret 2" and (tmp_path / "k.key").stat().st_mode & 0o777 == 0o600
    assert _leftovers(tmp_path) == []


# --- entry_state ------------------------------------------------------------------------------------------------------


@pytest.fixture
def listed(triton_cache, tmp_path):
    """The real toy cache and its entries' listings as a bundle records them."""
    return CacheDir(triton_cache), {e.key: e.files for e in pack(triton_cache, tmp_path / "b").index.entries}


def test_entry_state_against_a_listing(listed):
    cache, files = listed
    key, entry = next(iter(files.items()))
    assert all(cache.entry_state(k, f).intact for k, f in files.items())
    cubin = next(f.path for f in entry if f.path.endswith(".cubin"))
    data = (cache.root / key / cubin).read_bytes()

    (cache.root / key / cubin).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit
    s = cache.entry_state(key, entry)
    assert (s.modified, s.missing, s.unexpected, s.intact) == ([f"{key}/{cubin}"], [], [], False)

    (cache.root / key / cubin).unlink()
    s = cache.entry_state(key, entry)
    assert (s.modified, s.missing, s.unexpected) == ([], [f"{key}/{cubin}"], [])

    (cache.root / key / cubin).write_bytes(data)
    (cache.root / key / "stray.txt").write_text("x")
    os.mkdir(cache.root / key / "tmp.pid_1_2")
    (cache.root / key / "tmp.pid_1_2" / "k.cubin").write_bytes(data)  # a killed Triton's leftover
    s = cache.entry_state(key, entry)
    assert (s.modified, s.missing) == ([], [])
    assert s.unexpected == [f"{key}/stray.txt", f"{key}/tmp.pid_1_2/k.cubin"]


def test_entry_state_as_the_runtime_finds_it(listed, tmp_path):
    """No listing: each group file's children must be files of this entry dir (what Triton's get_group needs)."""
    cache, files = listed
    assert all(cache.entry_state(k).intact for k in files)
    key = next(iter(files))
    [group] = [f.path for f in files[key] if f.path.startswith("__grp__")]
    assert set(cache.entry_state(key).groups) == {group}

    moved = CacheDir(shutil.copytree(cache.root, tmp_path / "copied"))  # a copy without relocating its groups
    s = moved.entry_state(key)
    assert not s.intact and s.outside and all(str(cache.root / key) in o for o in s.outside)

    child = next(f.path for f in files[key] if f.path.endswith(".cubin"))
    (cache.root / key / child).unlink()
    assert cache.entry_state(key).missing == [f"{key}/{child}"]

    (cache.root / key / group).write_text("not json")
    s = cache.entry_state(key)
    assert s.groups == {group: None} and s.modified == [f"{key}/{group} (not a Triton group file)"]


# --- the layout -------------------------------------------------------------------------------------------------------


def test_build_pack_and_install_keep_their_files_where_the_cache_dir_says(tmp_path):
    synthetic_cache(tmp_path / "build", 2)
    build = CacheDir(tmp_path / "build")
    build.write_build_info({"manifest": {"name": "toy", "digest": "ab" * 32}})
    assert build.build_info == tmp_path / "build" / META / "build-info.json"
    assert build.read_build_info()["manifest"]["name"] == "toy"
    (build.root / "stray-file").write_text("not an entry")
    keys, skipped = build.entries()
    assert len(keys) == 2 and skipped == ["stray-file"]  # prewarm's own dir is neither

    r = pack(build.root, tmp_path / "bundle")
    assert r.index.manifest["name"] == "toy" and sorted(e.key for e in r.index.entries) == keys

    node = CacheDir(tmp_path / "node")
    res = install(str(tmp_path / "bundle"), node.root)
    assert [x.path for x in node.receipts()] == [node.receipt(res.index_digest)]
    assert node.receipt(res.index_digest).parent == tmp_path / "node" / META / "receipts"
    assert node.install_lock.exists() and node.staging_dirs() == []
    assert node.entries() == (keys, []) and node.read_toolchain() is None  # CUDA: no toolchain claim
    assert json.loads(node.receipt(res.index_digest).read_text())["seq"] == 1
