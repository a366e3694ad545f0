"""install: atomic, locked, idempotent, merging; refuses foreign toolchains and bad signatures."""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from prewarm.node import fingerprint
from prewarm.shipping.bundle import INDEX, parse_index
from prewarm.shipping.cachedir import META, CacheDir
from prewarm.errors import EnvironmentProblem, FingerprintMismatch, IntegrityError, SignatureError
from prewarm.shipping.install import _tasks, install
from prewarm.shipping.pack import pack
from prewarm.node.verify import verify

from prewarm_helpers import concurrent_installs, run_cli, synthetic_cache


def snapshot(cache: Path) -> dict[str, str]:
    """Every file of the cache outside prewarm's own dir, with its sha256."""
    return {
        p.relative_to(cache).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(cache.rglob("*"))
        if p.is_file() and META not in p.relative_to(cache).parts
    }


@pytest.fixture
def toy_bundle(triton_cache, tmp_path) -> Path:
    pack(triton_cache, tmp_path / "bundle")
    return tmp_path / "bundle"


def test_install_writes_receipt_and_repeat_is_a_noop(toy_bundle, tmp_path):
    node = tmp_path / "node"
    calls = []
    first = install(str(toy_bundle), node, progress=lambda *a: calls.append(a))
    assert (first.installed, first.present, first.noop) == (5, 0, False)
    assert calls == [(i, 5) for i in range(6)]  # staged entries, 0 to all, in order
    assert CacheDir(node).receipt(first.index_digest).exists()
    before = snapshot(node)
    mtimes = {p: p.stat().st_mtime_ns for p in node.rglob("*") if p.is_file()}
    calls.clear()
    again = install(str(toy_bundle), node, progress=lambda *a: calls.append(a))
    assert (again.installed, again.noop) == (0, True) and calls == []
    assert snapshot(node) == before
    assert {p: p.stat().st_mtime_ns for p in node.rglob("*") if p.is_file()} == mtimes
    assert not CacheDir(node).staging_dirs()


def test_install_merges_and_replaces_only_incomplete_entries(toy_bundle, tmp_path):
    node = synthetic_cache(tmp_path / "node", 3, seed=7)  # entries from another source (compiled on the node)
    foreign = snapshot(node)
    index = parse_index((toy_bundle / INDEX).read_bytes(), "t")
    broken = index.entries[0]
    (node / broken.key).mkdir()
    (node / broken.key / broken.files[0].path).write_bytes(b"half-written by a crashed process")
    res = install(str(toy_bundle), node)
    assert (res.installed, res.replaced) == (5, 1)
    after = snapshot(node)
    assert {k: v for k, v in after.items() if k in foreign} == foreign  # other sources' entries survive
    report = verify(node)
    assert report.ok and report.other_entries == 3 and report.entries_ok == 5


def test_the_c_member_loop_writes_every_plain_object_as_the_python_reader_does(triton_cache, tmp_path, monkeypatch):
    """Install's C member loop (prewarm/_fastunpack.c) writes every object pack wrote, a real Triton cache's included,
    without handing one to the Python reader, and the node gets the same files, modes and group files."""
    from prewarm.shipping import bundle

    assert bundle._fastunpack is not None, "prewarm/_fastunpack.c is not built: run pip install -e ."
    cache = synthetic_cache(tmp_path / "cache", 3, seed=5, scale=0.05)
    shutil.copytree(triton_cache, cache, dirs_exist_ok=True)
    next(cache.glob("*/k.cubin")).chmod(0o755)
    pack(cache, tmp_path / "bundle")

    def python_reader(*args):
        raise AssertionError("an object pack wrote went to the Python reader")

    monkeypatch.setattr(bundle, "_unpack_members", python_reader)
    install(str(tmp_path / "bundle"), tmp_path / "c")
    monkeypatch.undo()
    monkeypatch.setattr(bundle, "_fastunpack", None)
    install(str(tmp_path / "bundle"), tmp_path / "python")

    def files(node: Path) -> dict[str, tuple[bytes, int]]:
        return {p.relative_to(node).as_posix(): (p.read_bytes().replace(str(node).encode(), b"NODE"), p.stat().st_mode)
                for p in node.rglob("*") if p.is_file() and META not in p.relative_to(node).parts}

    written = files(tmp_path / "c")
    assert written == files(tmp_path / "python") and len(written) == len(files(cache))
    assert sum(mode & 0o111 != 0 for _, mode in written.values()) >= 1


def test_without_a_c_compiler_prewarm_builds_and_installs_through_the_python_reader(toy_bundle, tmp_path):
    """The C member loop is optional (setup.py): where no C compiler works (a node image without one or without
    Python's headers), building prewarm still succeeds, the wheel holds no extension, and that prewarm installs a
    bundle and verifies it, every object through the Python reader."""
    root, src = Path(__file__).resolve().parents[1], tmp_path / "src"
    for part in ("prewarm", "kernels"):
        shutil.copytree(root / part, src / part, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(root / name, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "wheel"), str(src)], env={**os.environ, "CC": "false"},
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    # a fresh environment: prewarm's dependencies from this one (a path entry, so its editable prewarm is not loaded)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    with zipfile.ZipFile(next((tmp_path / "wheel").glob("prewarm-*.whl"))) as wheel:
        assert "prewarm/shipping/bundle.py" in wheel.namelist()
        assert not [n for n in wheel.namelist() if n.endswith(".so")]
        wheel.extractall(site)

    def prewarm(*args: str) -> str:
        return subprocess.run([str(venv / "bin" / "python"), *args], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONSAFEPATH": "1"}).stdout  # not the checkout in cwd

    assert prewarm("-c", "import prewarm.shipping.bundle as b; print(b.__file__, b._fastunpack)").split() == [
        str(site / "prewarm" / "shipping" / "bundle.py"), "None"]
    out = json.loads(prewarm("-m", "prewarm.cli", "install", str(toy_bundle), "--cache-dir", str(tmp_path / "node"),
                             "--json"))
    assert out["installed"] == 5
    prewarm("-m", "prewarm.cli", "verify", "--cache-dir", str(tmp_path / "node"))


def test_cache_dir_defaults_to_triton_cache_dir(toy_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "from-env"))
    out = json.loads(run_cli("install", toy_bundle, "--json").stdout)
    assert out["cache_dir"] == str(tmp_path / "from-env") and out["installed"] == 5
    assert verify().ok


def test_16_concurrent_installs_unpack_each_entry_once(tmp_path):
    cache = synthetic_cache(tmp_path / "src", 60, seed=3)
    pack(cache, tmp_path / "bundle")
    results = concurrent_installs(tmp_path / "bundle", tmp_path / "node")
    assert sum(installed for installed, _ in results) == 60  # the work was done once
    assert sum(noop for _, noop in results) == 15
    assert verify(tmp_path / "node").ok


def test_sigkill_at_20_random_points_leaves_a_cache_that_verifies_and_rerun_completes(tmp_path):
    old = synthetic_cache(tmp_path / "old-src", 10, seed=1)
    new = synthetic_cache(tmp_path / "new-src", 50, seed=2, scale=0.1)
    shared = sorted(os.listdir(old))[0]
    shutil.copytree(old / shared, new / shared)  # one entry in both bundles
    pack(old, tmp_path / "A")
    pack(new, tmp_path / "B")
    fingerprint.current()
    ctx = multiprocessing.get_context("fork")
    full = float("inf")  # the fastest of 3 installs: the first of a process pays its imports, a busy box any one
    for i in range(3):
        t0 = time.monotonic()
        install(str(tmp_path / "B"), tmp_path / f"timing{i}")
        full = min(full, time.monotonic() - t0)
    rng = random.Random(20)
    node = tmp_path / "node"
    outcomes = []
    for i in range(20):
        shutil.rmtree(node, ignore_errors=True)
        install(str(tmp_path / "A"), node, durable=False)
        old_state = snapshot(node)
        p = ctx.Process(target=install, args=(str(tmp_path / "B"), str(node)))  # the default, durable install
        p.start()
        time.sleep(rng.uniform(0, full))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        outcomes.append(p.exitcode)
        report = verify(node, check_fingerprint=False)  # against the receipts present: old state, or old + new
        assert report.ok, (i, report.to_json())
        now = snapshot(node)
        assert {k: v for k, v in now.items() if k in old_state} == old_state  # the previous cache is intact
        against_new = verify(node, bundle=str(tmp_path / "B"), check_fingerprint=False)
        assert not (against_new.modified or against_new.unexpected)  # new entries: complete or absent
        assert all(not (node / m.split("/")[0]).exists() for m in against_new.missing)
        rerun = install(str(tmp_path / "B"), node, durable=False)
        assert rerun.installed + rerun.present == rerun.entries
        final = verify(node, check_fingerprint=False)
        assert final.ok and final.entries == 10 + 50
    assert outcomes.count(-signal.SIGKILL) >= 10  # most kills really landed mid-install (the rest: after it)


def _fingerprint_bundle(triton_cache: Path, tmp_path: Path, **changes) -> Path:
    fp = dict(fingerprint.current())
    fp.update(changes)
    CacheDir(triton_cache).write_build_info({"fingerprint": fp})
    pack(triton_cache, tmp_path / "bundle")
    return tmp_path / "bundle"


def test_fingerprint_mismatch_is_refused_naming_each_factor(triton_cache, tmp_path):
    bundle = _fingerprint_bundle(triton_cache, tmp_path, **{"triton.version": "3.5.1", "python.abi": "cpython-311-x86_64",
                                                             "torch.version": "2.9.0"})
    node = tmp_path / "node"
    with pytest.raises(FingerprintMismatch) as e:
        install(str(bundle), node)
    msg = str(e.value)
    assert "triton.version" in msg and "3.5.1" in msg and "python.abi" in msg and "torch.version" not in msg
    assert not snapshot(node) if node.exists() else True
    p = run_cli("install", bundle, "--cache-dir", node, check=FingerprintMismatch.exit_code)
    assert "triton.version" in p.stderr
    ok = install(str(bundle), node, allow_fingerprint_mismatch=True)
    assert ok.installed == 5 and {m.factor for m in ok.mismatches} == {"triton.version", "python.abi", "torch.version"}
    assert verify(node).exit_code == FingerprintMismatch.exit_code  # verify still reports it


def test_signatures_trusted_wrong_key_required_and_tampered(triton_cache, tmp_path):
    from prewarm.shipping.signing import keygen

    run_cli("keygen", "-o", tmp_path / "good")
    keygen(tmp_path / "evil")
    run_cli("pack", triton_cache, "-o", tmp_path / "signed", "--sign", tmp_path / "good.key")
    pack(triton_cache, tmp_path / "unsigned")
    good, evil = str(tmp_path / "good.pub"), str(tmp_path / "evil.pub")

    r = install(str(tmp_path / "signed"), tmp_path / "n1", trusted_keys=[good], require_signature=True)
    assert r.installed == 5 and r.signed_by

    with pytest.raises(SignatureError, match="not among the trusted keys"):
        install(str(tmp_path / "signed"), tmp_path / "n2", trusted_keys=[evil])
    with pytest.raises(SignatureError, match="no signature"):
        install(str(tmp_path / "unsigned"), tmp_path / "n2", trusted_keys=[good], require_signature=True)
    run_cli("install", tmp_path / "unsigned", "--cache-dir", tmp_path / "n2", "--require-signature", "--trust", good,
            check=SignatureError.exit_code)

    # a forged index (valid checksum, other content) under the genuine signature
    shutil.copytree(tmp_path / "signed", tmp_path / "forged")
    index = parse_index((tmp_path / "signed" / INDEX).read_bytes(), "t")
    from prewarm.shipping.bundle import Index

    forged = Index(index.fingerprint, index.manifest, index.entries[1:]).to_bytes()
    (tmp_path / "forged" / INDEX).write_bytes(forged)
    with pytest.raises(SignatureError, match="does not verify"):
        install(str(tmp_path / "forged"), tmp_path / "n2", trusted_keys=[good])
    assert not (tmp_path / "n2").exists() or not snapshot(tmp_path / "n2")


def _install_with_fsize_limit(bundle: str, cache: str, q) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # every write past 4 KiB fails: EFBIG
    try:
        install(bundle, cache)
        q.put(None)
    except EnvironmentProblem as e:
        q.put(("EnvironmentProblem", str(e)))
    except BaseException as e:
        q.put((type(e).__name__, str(e)))


def test_write_failure_is_an_environment_problem_and_leaves_previous_cache(toy_bundle, tmp_path):
    node = synthetic_cache(tmp_path / "node", 2, seed=9)
    before = snapshot(node)
    fingerprint.current()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_install_with_fsize_limit, args=(str(toy_bundle), str(node), q))
    p.start()
    kind, msg = q.get(timeout=120)
    p.join()
    assert kind == "EnvironmentProblem" and "File too large" in msg and str(node) in msg
    assert snapshot(node) == before and not CacheDir(node).staging_dirs()


# --- presence by content, non-reproducible C modules, repair (issue 13) ---------------------------------------

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
    """The toy manifest built twice, offline, for real, and packed: same keys, the same kernels and launchers, but
    ``cuda_utils`` built twice by the host C compiler, so under one key with different bytes: as two build hosts'
    compilers make it (Triton 3.6 builds cuda_utils from a temporary copy of its source, so even one host's builds
    differ; 3.8 builds it from the installed file, and no launchers, so its second build here adds debug info, as
    another compiler's output would differ)."""
    import shutil
    import sys

    sys.path.insert(0, str(FIXTURES))  # the toy provider, importable by the build's worker processes
    from prewarm.building.build import build
    from prewarm.building.tritoncompat import release, restored_env

    root = tmp_path_factory.mktemp("two-builds")
    other_cc = root / "cc-g"
    other_cc.write_text(f'#!/bin/sh\nexec "{shutil.which("gcc") or shutil.which("clang")}" -g "$@"\n')
    other_cc.chmod(0o755)
    bundles = []
    for name in ("a", "b"):
        with restored_env("CC"):
            if name == "b" and release().cuda_launchers == "generic":
                os.environ["CC"] = str(other_cc)  # the key does not read the compiler: the same key
            build(FIXTURES / "toy-cuda.toml", root / name, workers=2, mode="offline")
        pack(root / name, root / f"bundle-{name}", sequence=7)  # one release built on two hosts: one sequence
        bundles.append(root / f"bundle-{name}")
    return bundles


def _cuda_utils(bundle: Path):
    index = parse_index((bundle / INDEX).read_bytes(), "t")
    (entry,) = [e for e in index.entries if e.files[0].path.startswith("cuda_utils")]
    return entry


def test_two_genuine_bundles_sharing_a_rebuilt_cuda_utils_install_in_either_order_and_verify_clean(
        two_builds, tmp_path):
    a, b = two_builds
    ua, ub = _cuda_utils(a), _cuda_utils(b)
    assert ua.key == ub.key and ua.files[0].sha256 != ub.files[0].sha256  # the C build is not reproducible
    for first, second in ((a, b), (b, a)):
        node = tmp_path / f"node-{first.name}"
        install(str(first), node)
        r = install(str(second), node)
        assert (r.installed, r.kept, r.present) == (0, 1, r.entries)  # kept as built, recorded as it is on disk
        report = verify(node)
        assert report.ok, report.to_json()
        assert _sha(node / ua.key / ua.files[0].path) == _cuda_utils(first).files[0].sha256
        assert install(str(first), node).noop and install(str(second), node).noop  # install and verify agree
        assert verify(node, bundle=str(first)).ok and verify(node, bundle=str(second)).ok
        assert run_cli("verify", "--cache-dir", node).returncode == 0


def test_a_same_size_flip_in_an_installed_file_is_found_by_verify_and_repaired_by_a_recheck(two_builds, tmp_path):
    """A file rewritten in place (same inode, size and mtime) leaves its entry's stamp as it was: a plain re-install
    trusts the stamp (it reads no file), verify hashes and finds it, ``recheck`` checks by content and repairs."""
    a, b = two_builds
    node = tmp_path / "node"
    install(str(a), node)
    install(str(b), node)  # cuda_utils: a's bytes, kept, recorded by b's receipt
    cubin = sorted(node.glob("*/*.cubin"))[0]
    utils = next(node.glob("*/cuda_utils*.so"))
    for path, repaired in ((cubin, cubin.read_bytes()), (utils, None)):
        flipped = bytearray(path.read_bytes())
        flipped[len(flipped) // 2] ^= 0x10
        st = path.stat()
        path.write_bytes(bytes(flipped))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the content differs
        for report in (verify(node), verify(node, bundle=str(a)), verify(node, bundle=str(b))):
            assert report.modified == [path.relative_to(node).as_posix()]
            assert report.exit_code == IntegrityError.exit_code
        assert install(str(b), node).noop  # by stamp: what a tool writing whole files and renaming them would move
        r = install(str(b), node, recheck=True)
        assert (r.noop, r.installed, r.replaced) == (False, 1, 1)
        assert verify(node).ok
        assert path.read_bytes() == repaired if repaired else _sha(path) == _cuda_utils(b).files[0].sha256
    r = install(str(a), node)  # a's receipt now records b's cuda_utils as kept: verify and install still agree
    assert (r.installed, r.kept, r.noop) == (0, 1, False) and install(str(a), node).noop
    assert verify(node).ok


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_receipts_carry_a_sequence_not_a_timestamp(toy_bundle, triton_cache, tmp_path):
    """Two installs within one second: the later one still wins where bundles share a key (and verify uses it)."""
    other = synthetic_cache(tmp_path / "other", 2, seed=5)
    pack(other, tmp_path / "other-bundle")
    node = tmp_path / "node"
    first = install(str(toy_bundle), node)
    second = install(str(tmp_path / "other-bundle"), node)
    seqs = {r.index.digest: r.seq for r in CacheDir(node).receipts()}
    assert seqs == {first.index_digest: 1, second.index_digest: 2}
    receipt = json.loads(CacheDir(node).receipt(second.index_digest).read_text())
    assert receipt["seq"] == 2 and receipt["kept"] == {}
    assert not list(CacheDir(node).receipts_dir.glob(".*.tmp"))  # written through a temp file, replaced


# --- the fingerprint fails closed (issue 13) --------------------------------------------------------------------


def _bundle_with_fingerprint(cache: Path, out: Path, fp: dict) -> Path:
    CacheDir(cache).write_build_info({"fingerprint": fp})
    pack(cache, out)
    return out


@pytest.mark.parametrize("change, factor, why", [
    ({"target.backend": "hip"}, "target.backend", "another backend"),  # the node's backend, never the bundle's
    ({"triton.key": None}, "triton.key", "the bundle does not record it"),
    ({"triton.key": "unknown"}, "triton.key", "the bundle does not record it"),
    ({"cuda.ptxas": None, "python.abi": None}, "python.abi", "the bundle does not record it"),
    ({"triton.backend_hash": "x"}, "triton.backend_hash", "a factor this node does not have"),
])
def test_fingerprint_gaps_and_foreign_backends_are_refused(triton_cache, tmp_path, change, factor, why):
    fp = dict(fingerprint.current())
    for k, v in change.items():
        fp.pop(k) if v is None else fp.__setitem__(k, v)
    bundle = _bundle_with_fingerprint(triton_cache, tmp_path / "bundle", fp)
    node = tmp_path / "node"
    p = run_cli("install", bundle, "--cache-dir", node, check=FingerprintMismatch.exit_code)
    assert factor in p.stderr and why in p.stderr and "Traceback" not in p.stderr
    assert not node.exists() or not snapshot(node)
    gap = why != "another backend"
    flag = "--allow-missing-factors" if gap else "--allow-fingerprint-mismatch"
    assert flag in p.stderr
    other = "--allow-fingerprint-mismatch" if gap else "--allow-missing-factors"
    run_cli("install", bundle, "--cache-dir", node, other, check=FingerprintMismatch.exit_code)  # the other is not it
    run_cli("install", bundle, "--cache-dir", node, flag)
    assert verify(node).exit_code == FingerprintMismatch.exit_code  # verify still says so


def test_an_empty_fingerprint_is_refused_naming_every_blocking_factor(triton_cache, tmp_path):
    bundle = _bundle_with_fingerprint(triton_cache, tmp_path / "bundle", {})
    with pytest.raises(FingerprintMismatch) as e:
        install(str(bundle), tmp_path / "node")
    for factor in ("triton.distribution", "triton.version", "triton.key", "python.abi", "target.backend",
                   "cuda.ptxas"):
        assert f"{factor}: bundle has '(not recorded)'" in str(e.value)
    assert "target.arch" not in str(e.value)  # detected from a device: unknown here on both sides, not compared


# --- issue 28 / 27: install and a repeated install that scale with what changed ----------------------------------

_COUNT_OPENS = """
import os, sys
from pathlib import Path
cache, bundle = sys.argv[2], sys.argv[1]
opened = []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if not (args[2] or 0) & os.O_DIRECTORY and (path.startswith(bundle + "/objects") or
                                                     path.startswith(cache) and "/.prewarm" not in path):
            opened.append(path)
sys.addaudithook(hook)
import prewarm.shipping.install
from prewarm.shipping.install import install
if os.path.isdir(cache):
    prewarm.shipping.install.parse_index = None  # a repeated install decides from its receipt: the index is never parsed
r = install(bundle, cache, workers=int(sys.argv[3]))
print(r.noop, len(opened), "triton" in sys.modules)
"""


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    """A bundle of 600 small entries: enough for install to fork its workers."""
    root = tmp_path_factory.mktemp("many")
    pack(synthetic_cache(root / "cache", 600, seed=11, scale=0.005), root / "bundle")
    return root / "bundle"


@pytest.mark.parametrize("workers", [1, 2])  # in this process (threads) and in forked workers
def test_a_repeated_install_reads_no_object_no_file_and_not_the_index(many, tmp_path, workers):
    def once() -> list[str]:
        return subprocess.run([sys.executable, "-c", _COUNT_OPENS, str(many), str(tmp_path / "node"), str(workers)],
                              capture_output=True, text=True, check=True).stdout.split()

    assert once()[0] == "False"  # installed (the index parsed: it is the same module, replaced only below)
    assert once() == ["True", "0", "False"]  # a no-op: no file or object opened, no index parsed, no triton import


def test_a_changed_entry_is_found_among_many_and_only_it_is_repaired(many, tmp_path):
    node = tmp_path / "node"
    install(str(many), node, durable=False)
    keys = sorted(p.name for p in node.iterdir() if p.name != META)
    replaced, gone, stray = (node / k for k in keys[10:13])
    cubin = next(replaced.glob("*.cubin"))
    data = bytearray(cubin.read_bytes())
    data[0] ^= 1
    (replaced / "new").write_bytes(bytes(data))
    os.replace(replaced / "new", cubin)  # rewritten whole and renamed over it, as tools (and Triton) write
    next(gone.glob("*.ptx")).unlink()
    (stray / "tmp.pid_1_2").mkdir()  # a compile killed while it wrote into the entry
    (stray / "tmp.pid_1_2" / "k.cubin").write_bytes(b"half")
    r = install(str(many), node, durable=False)
    assert (r.noop, r.installed, r.replaced, r.present) == (False, 3, 3, 597)
    assert verify(node).ok
    assert install(str(many), node, durable=False).noop


def test_forked_workers_get_ranges_that_tile_the_entries_and_shrink_to_single_entries():
    """The workers finish together: no worker idles through another's last large range."""
    for count in (1, 600, 2000, 100_000):
        tasks = _tasks(count, 2)
        assert [a for a, _ in tasks] == [0] + [b for _, b in tasks[:-1]] and tasks[-1][1] == count
        sizes = [b - a for a, b in tasks]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] <= 64 and sizes[-4:] == [1] * min(4, count)


def test_memory_is_bounded_per_entry_not_per_file(many):
    """A parsed index keeps its bytes and a fixed handful of fields per entry: no object per file, whatever the
    number of files (decoded when an entry's files are read)."""
    import gc

    from prewarm.shipping.bundle import Entry, FileRecord

    def records() -> int:  # counted before and after: an earlier test in this process may keep some alive
        gc.collect()
        return sum(type(o) is FileRecord for o in gc.get_objects())

    before = records()
    index = parse_index((many / INDEX).read_bytes(), "t")  # every record checked, none kept
    assert len(index.entries) == 600 and index.total_size > 0
    assert records() == before
    assert Entry.__slots__ and not hasattr(index.entries[0], "__dict__")
    sizes = {type(v).__name__ for e in index.entries for v in (getattr(e, s) for s in Entry.__slots__)}
    assert sizes <= {"str", "int", "tuple", "NoneType", "_Source"}  # the tuple: an (offset, end) span
    assert len(index.entries[0].files) == 4  # decoded on demand


def test_the_receipt_holds_a_stamp_per_entry_not_a_record_per_file(many, tmp_path):
    r = install(str(many), tmp_path / "node", durable=False)
    receipt = json.loads(CacheDir(tmp_path / "node").receipt(r.index_digest).read_text())
    assert len(receipt["entries"]) == 600
    cache = CacheDir(tmp_path / "node")
    assert all(len(obj) == 72 and stamp == cache.stamp(key) and re.fullmatch(r"\d+:\d+:\d+", stamp)
               for key, (obj, stamp) in receipt["entries"].items())
    assert CacheDir(tmp_path / "node").receipt(r.index_digest).with_suffix(".index").read_bytes() == (
        many / INDEX).read_bytes()


def test_a_receipt_from_before_stamps_is_read_and_replaced(toy_bundle, tmp_path):
    """A receipt of prewarm 0.1 (the index inline, no stamps): verify and `prewarm ls` read it; the next install
    checks every entry by content once and writes the current form."""
    node = tmp_path / "node"
    r = install(str(toy_bundle), node)
    path = CacheDir(node).receipt(r.index_digest)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({"seq": 1, "source": "x", "signed_by": None, "cache_dir": str(node), "kept": {},
                                "index": (toy_bundle / INDEX).read_text()}))
    path.with_suffix(".index").unlink()
    assert verify(node).ok and CacheDir(node).receipts()[0].entries.keys() == doc["entries"].keys()
    again = install(str(toy_bundle), node)
    assert (again.installed, again.present, again.noop) == (0, 5, False)
    assert json.loads(path.read_text())["entries"] == doc["entries"] and install(str(toy_bundle), node).noop


# --- the node's fingerprint, reused while what it is computed from is unchanged --------------------------------


_NODE = """
import sys
from prewarm.errors import PrewarmError
from prewarm.shipping.install import install
from prewarm.shipping.nodestamp import node_fingerprint
try:
    if sys.argv[1] == "install":
        install(sys.argv[2], sys.argv[3], durable=False)
    print(node_fingerprint(sys.argv[3])["cuda.ptxas"], "triton" in sys.modules)
except PrewarmError as e:
    print(type(e).__name__, e)
"""


def test_a_node_fingerprint_is_reused_only_while_its_inputs_are_unchanged(toy_bundle, tmp_path):
    """A stand-in ptxas (TRITON_PTXAS_PATH) whose version the test changes: the recorded fingerprint must not
    outlive it, and is reused, Triton not even imported, while nothing changed. It starts as the ptxas this Triton
    ships (the bundle's: 12.8 with Triton 3.6, 12.9 with 3.8)."""
    from prewarm.building import tritoncompat

    real = subprocess.run([tritoncompat.ptxas_path(), "--version"], capture_output=True, text=True, check=True).stdout
    built_by = real.strip().splitlines()[-1]
    ptxas = tmp_path / "ptxas"
    ptxas.write_text(f"#!/bin/sh\ncat <<'EOF'\n{real.strip()}\nEOF\n")
    ptxas.chmod(0o755)
    node = tmp_path / "node"

    def run(step: str, **env) -> str:
        return subprocess.run([sys.executable, "-c", _NODE, step, str(toy_bundle), str(node)], capture_output=True,
                              text=True, check=True, env={**os.environ, "TRITON_PTXAS_PATH": str(ptxas), **env}
                              ).stdout.strip()

    assert run("install") == f"{built_by} True"  # computed, and recorded
    assert run("probe") == f"{built_by} False"  # reused: Triton not imported
    assert run("probe", PREWARM_TEST_POD_NAME="pod-2").endswith("True")  # a variable never seen: computed afresh
    ptxas.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.1'\n"
                     "echo 'Build cuda_13.0.r13.0/compiler.1_0'\n")
    assert run("probe") == "Build cuda_13.0.r13.0/compiler.1_0 True"  # the tool changed: so did the factor
    assert run("install").startswith("FingerprintMismatch") and "cuda.ptxas" in run("install")


def test_a_variable_triton_folds_into_its_key_is_never_ignored(toy_bundle, tmp_path):
    node = tmp_path / "node"
    run_cli("install", toy_bundle, "--cache-dir", node)
    p = run_cli("install", toy_bundle, "--cache-dir", node, env={**os.environ, "MLIR_ENABLE_DUMP": "1"},
                check=FingerprintMismatch.exit_code)
    assert "env.MLIR_ENABLE_DUMP" in p.stderr
