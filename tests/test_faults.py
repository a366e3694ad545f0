"""Fault injection (issue 13): what a node meets in the field, in one file that stays under a minute.

A tamper sample (random flips of objects, index, signature), SIGKILL while a modified entry is being repaired,
concurrent installs of different bundles into one dir, memory bounded by the chunk size for a large entry, and
full or read-only filesystems (real tmpfs mounts; needs root, as on the CI box). Every refusal leaves the node's
cache byte-identical; every interrupted install verifies after a rerun.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prewarm.node import fingerprint
from prewarm.shipping.bundle import INDEX, OBJECTS, SIGNATURE
from prewarm.shipping.cachedir import META, CacheDir
from prewarm.errors import EnvironmentProblem, PrewarmError
from prewarm.shipping.install import install
from prewarm.shipping.pack import pack
from prewarm.shipping.signing import keygen
from prewarm.node.verify import verify

from prewarm_helpers import run_cli, synthetic_cache


def snapshot(cache: Path) -> dict[str, str]:
    return {p.relative_to(cache).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(cache.rglob("*")) if p.is_file() and META not in p.relative_to(cache).parts}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """Two bundles of synthetic caches (A signed) and the public key."""
    root = tmp_path_factory.mktemp("faults")
    a, b = synthetic_cache(root / "a", 6, seed=1, scale=0.05), synthetic_cache(root / "b", 12, seed=2, scale=0.05)
    _, pub, _ = keygen(root / "key")
    pack(a, root / "A", signing_key=root / "key.key")
    pack(b, root / "B")
    fingerprint.current()  # paid once; forked children inherit it
    return root / "A", root / "B", str(pub)


def test_tamper_sample_every_flip_is_refused_and_the_cache_is_untouched(bundles, tmp_path):
    a, b, pub = bundles
    node = tmp_path / "node"
    install(str(b), node)
    before = snapshot(node)
    rng = random.Random(13)
    targets = sorted((a / OBJECTS).iterdir()) + [a / INDEX, a / SIGNATURE]
    codes = []
    for _ in range(40):
        target = rng.choice(targets)
        good = target.read_bytes()
        bad = bytearray(good)
        bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(bad))
        try:
            install(str(a), node, trusted_keys=[pub], require_signature=True)
            codes.append(0)
        except PrewarmError as e:
            codes.append(e.exit_code)
        finally:
            target.write_bytes(good)
        assert snapshot(node) == before and not CacheDir(node).staging_dirs()
    assert 0 not in codes and set(codes) <= {6, 7, 9}, codes
    assert install(str(a), node, trusted_keys=[pub], require_signature=True).installed == 6 and verify(node).ok


def test_sigkill_while_a_modified_entry_is_repaired_then_rerun_verifies(bundles, tmp_path):
    a, b, _ = bundles
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(7)
    for i in range(5):
        node = tmp_path / f"node{i}"
        install(str(b), node, durable=False)
        victims = rng.sample(sorted(node.glob("*/*")), 3)
        for v in victims:  # same-size flips: only a content check sees them
            data = bytearray(v.read_bytes())
            data[len(data) // 2] ^= 0x04
            v.write_bytes(bytes(data))
        # rewritten in place: their entries' stamps did not move, so only a content check (recheck) sees them
        p = ctx.Process(target=install, args=(str(b), str(node)), kwargs={"recheck": True})
        p.start()
        time.sleep(rng.uniform(0, 0.3))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        r = verify(node, check_fingerprint=False)  # the old receipt: the flips not yet repaired show, nothing else
        assert not (r.missing or r.unexpected) and set(r.modified) <= {v.relative_to(node).as_posix() for v in victims}
        install(str(b), node, durable=False, recheck=True)
        assert verify(node, check_fingerprint=False).ok


def _install(bundle: str, cache: str, q) -> None:
    try:
        r = install(bundle, cache)
        q.put(("ok", r.installed))
    except BaseException as e:
        q.put((type(e).__name__, str(e)))


def test_concurrent_installs_of_different_bundles_into_one_dir(bundles, tmp_path):
    a, b, _ = bundles
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_install, args=(str(x), str(tmp_path / "node"), q)) for x in (a, b) * 4]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert all(kind == "ok" for kind, _ in results), results
    assert sum(n for _, n in results) == 6 + 12  # each entry unpacked once
    assert sorted(r.seq for r in CacheDir(tmp_path / "node").receipts()) == [1, 2]
    assert verify(tmp_path / "node").ok


_MEASURE = """
import re, sys
from prewarm.shipping.install import install
install(sys.argv[1], sys.argv[2])
print(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))  # this process's own peak
"""


def test_install_memory_is_bounded_by_the_chunk_not_the_entry(tmp_path):
    """A 160 MiB entry installs within a few MiB of a tiny one's peak RSS (before issue 13: 411 MiB against 77)."""
    big = tmp_path / "big" / ("B" * 51 + "A")  # a base32 sha256: Triton's own key form
    big.mkdir(parents=True)
    with open(big / "k.cubin", "wb") as f:
        for i in range(160):
            f.write(hashlib.sha256(str(i).encode()).digest() * (1 << 15))  # 1 MiB, compressible, not zeros
    pack(big.parent, tmp_path / "big-bundle")
    (big / "k.cubin").unlink()
    small = synthetic_cache(tmp_path / "small", 1, seed=3, scale=0.01)
    pack(small, tmp_path / "small-bundle")
    peak = {}
    for name in ("small", "big"):
        out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / f"{name}-bundle"),
                              str(tmp_path / f"node-{name}")], capture_output=True, text=True, check=True)
        peak[name] = int(out.stdout.split()[-1]) / 1024  # MiB
    assert peak["big"] - peak["small"] < 40, peak
    assert verify(tmp_path / "node-big").ok


@pytest.fixture
def tmpfs(tmp_path):
    """A real tmpfs of 2 MiB: full and read-only filesystems as a node meets them (mount needs root)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {p.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_full_and_read_only_filesystems_are_exit_11_and_keep_the_cache(bundles, tmp_path, tmpfs):
    a, b, _ = bundles
    node = tmpfs / "node"
    install(str(a), node)
    before = snapshot(node)
    filler = tmpfs / "filler"
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    filler.write_bytes(b"\0" * max(0, free - 8192))  # nearly full: B's entries cannot be staged
    with pytest.raises(EnvironmentProblem, match="No space left on device"):
        install(str(b), node)
    assert snapshot(node) == before and not CacheDir(node).staging_dirs() and verify(node).ok
    p = run_cli("pack", node, "-o", tmpfs / "bundle", check=EnvironmentProblem.exit_code)
    assert "No space left" in p.stderr and "Traceback" not in p.stderr
    assert not [f for f in tmpfs.rglob("*.tmp")]
    filler.unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    for args in (["install", b, "--cache-dir", node], ["pack", node, "-o", tmpfs / "bundle2"],
                 ["keygen", "-o", tmpfs / "k"]):
        p = run_cli(*args, check=EnvironmentProblem.exit_code)
        assert "Read-only file system" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert snapshot(node) == before and verify(node).ok  # verify reads only
    assert json.loads(run_cli("verify", "--cache-dir", node, "--json").stdout)["ok"]


# --- install's forked workers (issue 27/28): the same guarantees when the work is spread over processes ---------


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A bundle of 600 small entries (install forks workers from 512) and one of 6 others sharing none of them."""
    root = tmp_path_factory.mktemp("wide")
    pack(synthetic_cache(root / "cache", 600, seed=21, scale=0.005), root / "W")
    return root / "W"


def test_sigkill_of_an_install_with_forked_workers_leaves_nothing_half_written(bundles, wide, tmp_path):
    a, _, _ = bundles
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(27)
    t0 = time.monotonic()
    install(str(wide), tmp_path / "timing")
    full = time.monotonic() - t0
    for i in range(4):
        node = tmp_path / f"node{i}"
        install(str(a), node, durable=False)
        before = snapshot(node)
        p = ctx.Process(target=install, args=(str(wide), str(node)))
        p.start()
        time.sleep(rng.uniform(0.1, full))
        os.kill(p.pid, signal.SIGKILL)  # the workers it forked are orphaned mid-entry: they finish it and exit
        p.join()
        report = verify(node, check_fingerprint=False)
        assert report.ok, report.to_json()
        assert {k: v for k, v in snapshot(node).items() if k in before} == before
        against = verify(node, bundle=str(wide), check_fingerprint=False)
        assert not (against.modified or against.unexpected)  # each entry complete or absent
        rerun = install(str(wide), node, durable=False)  # waits for the orphans' lock, clears their staging
        assert rerun.installed + rerun.present == 600 and not CacheDir(node).staging_dirs()
        assert verify(node, check_fingerprint=False).ok


def test_a_filesystem_filling_up_under_forked_workers_is_exit_11_and_keeps_the_cache(bundles, wide, tmpfs):
    """The `prewarm install` process forks its workers (600 entries); one of them, or the parent writing the index
    beside the receipt, meets ENOSPC partway: exit 11 naming it, the cache and its receipts as they were, no staging
    dir left."""
    a, _, _ = bundles
    node = tmpfs / "node"
    install(str(a), node)
    before, receipts = snapshot(node), sorted(os.listdir(CacheDir(node).meta / "receipts"))
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    (tmpfs / "filler").write_bytes(b"\0" * max(0, free - (256 << 10)))  # room for a few of the 600 entries
    p = run_cli("install", wide, "--cache-dir", node, check=EnvironmentProblem.exit_code)
    message = " ".join(p.stderr.split())
    assert "Traceback" not in message, message
    assert re.search(rf"{re.escape(str(node))}/\S+: No space left on device", message), message  # the file, named
    assert snapshot(node) == before and sorted(os.listdir(CacheDir(node).meta / "receipts")) == receipts
    assert not CacheDir(node).staging_dirs() and verify(node).ok


def test_an_install_from_a_process_running_another_thread_settles_every_entry_in_threads(wide, tmp_path):
    """A library caller with a thread of its own (a server, a test runner's channel) is never forked from: the same
    install runs in threads, and must not let go of what those threads still read."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        res = install(str(wide), tmp_path / "node", durable=False)
    finally:
        stop.set()
    assert res.installed == 600
    assert verify(tmp_path / "node", bundle=str(wide), check_fingerprint=False).ok


def test_concurrent_installs_with_forked_workers_unpack_each_entry_once(wide, tmp_path):
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_install, args=(str(wide), str(tmp_path / "node"), q)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    assert sorted(n for _, n in results) == [0, 0, 0, 600], results
    assert verify(tmp_path / "node").ok
