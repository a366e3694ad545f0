"""Build: every planned compile lands in the cache dir through the real JIT path, in worker processes; a second
build compiles nothing; failures carry the compiler's message and exit code 4; the build record is written."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.building.build import build  # noqa: E402
from prewarm.shipping.cachedir import META, CacheDir  # noqa: E402
from prewarm.cli import main  # noqa: E402
from prewarm.errors import BuildError, EnvironmentProblem, ManifestError  # noqa: E402

TOY = FIXTURES / "toy-cuda.toml"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    seen = []
    report = build(TOY, cache, workers=2, mode="offline", progress=lambda r, done, total: seen.append((done, total)))
    return cache, report, seen


def test_first_build_compiles_every_planned_request(built):
    cache, report, seen = built
    assert report.ok and report.requests == 8 and len(report.results) == 11
    assert report.count("compiled") == 11 and report.count("present") == 0
    assert seen[-1] == (11, 11) and len(seen) == 11
    for r in report.results:
        entry = cache / r.key
        name = r.kernel.split(":")[1]
        group = json.loads((entry / f"__grp__{name}.json").read_text())["child_paths"]
        assert f"{name}.cubin" in group and all(os.path.exists(p) for p in group.values()), r.label
    assert any("no autotune results" in n for n in report.notes)  # the offline caveat is said, not hidden


# Runs in a fresh process against an offline-built cache: cuda_utils through the driver's own class, then every
# kernel of the plan as the runtime loads it (a disk hit) and its launcher (3.6: a module per kernel signature; 3.8:
# cuda_utils' launch). Building is made to fail and loading the .so (which needs the NVIDIA driver) is stubbed: success
# means Triton found each file under its own key. On 3.8 the node finds libcuda.so.1 where the manifest says by
# default (its `ldconfig -p`: the image's library dir, where NVIDIA's container toolkit mounts the driver).
RUNTIME_LOOKUP = """
import sys
from unittest import mock
import triton.runtime.build as tb
from triton.backends.nvidia import driver as nv
from triton.runtime.driver import driver
from prewarm.building import tritoncompat
from prewarm.planning.manifest import load
from prewarm.planning.plan import expand_all, plan, resolve
from prewarm.building.backends import CudaOfflineTarget
from prewarm.building.backends.cuda import NODE_LIBCUDA_DIRS

tritoncompat.set_cache_dir(sys.argv[1])
CudaOfflineTarget("cuda", "sm_90").activate()
def no_build(name, *a, **k):
    raise AssertionError(f"Triton had to build {name}: not in the cache")
tb._build = no_build
tb._load_module_from_path = lambda name, path: mock.MagicMock(name=path)
if "library_dirs" in tritoncompat.release().cuda_utils_key:
    nv.libcuda_dirs = lambda: list(NODE_LIBCUDA_DIRS)
driver.active.utils = nv.CudaUtils()
n = 0
for c in expand_all(plan(load(sys.argv[2])).requests):
    kernel = tritoncompat.preload(resolve(c.kernel), c.specialization)
    nv.CudaLauncher(kernel.src, kernel.metadata)
    n += 1
print(n)
"""


def test_offline_build_holds_every_launcher_and_cuda_utils_under_tritons_keys(built, tmp_path):
    import subprocess

    from prewarm.building import tritoncompat

    cache, report, _ = built
    so = sorted(cache.rglob("*.so"))
    names = {p.name.split(".")[0] for p in so}
    per_signature = tritoncompat.release().cuda_launchers == "per-signature"
    assert names == ({"__triton_launcher", "cuda_utils"} if per_signature else {"cuda_utils"})
    assert any(("the launchers of 11 kernels" if per_signature else "no launcher per kernel signature: not needed") in n
               for n in report.notes)  # what was built for the first launch is said
    # linked against libcuda.so.1 (a stub here), as on a GPU host: the node's driver resolves the cu* symbols
    for path in so:
        needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
        assert "[libcuda.so.1]" in needed, path
    driver = tmp_path / "driver"  # a node has the NVIDIA driver: the launcher classes check that libcuda.so.1 exists
    driver.mkdir()
    (driver / "libcuda.so.1").touch()
    env = {**os.environ, "PYTHONPATH": str(FIXTURES), "TRITON_LIBCUDA_PATH": str(driver)}
    env.pop("TRITON_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", RUNTIME_LOOKUP, str(cache), str(TOY)], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "11"


def test_build_info_lists_manifest_fingerprint_and_keys(built):
    cache, report, _ = built
    rec = CacheDir(cache).read_build_info()
    assert rec["manifest"]["name"] == "toy-cuda" and rec["manifest"]["digest"] == report.digest
    from prewarm.building import tritoncompat

    assert rec["fingerprint"]["triton.version"] == tritoncompat.triton_distribution()[1]
    assert rec["fingerprint"]["target.arch"] == "sm_90"
    assert rec["target"] == {"backend": "cuda", "arch": "sm_90", "mode": "offline"}
    assert [(r["label"], r["key"]) for r in rec["requests"]] == [(r.label, r.key) for r in report.results]
    assert len({r["key"] for r in rec["requests"]}) == 11


def test_second_build_compiles_nothing(built, capsys):
    cache, report, _ = built
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if META not in p.parts}
    assert main(["build", str(TOY), "--cache-dir", str(cache), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["compiled"], doc["present"], doc["failed"]) == (0, 11, 0)
    assert [r["key"] for r in doc["results"]] == [r.key for r in report.results]
    after = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if META not in p.parts}
    assert after == before  # not a file touched


def test_failures_carry_the_compiler_message(tmp_path, capsys):
    code = main(["build", str(FIXTURES / "toy-broken.toml"), "--cache-dir", str(tmp_path), "--workers", "2",
                 "--json"])
    assert code == BuildError.exit_code == 4
    doc = json.loads(capsys.readouterr().out)
    assert (doc["compiled"], doc["failed"]) == (1, 1)
    (bad,) = [r for r in doc["results"] if r["status"] == "failed"]
    assert bad["label"] == "broken_kernel BLOCK=48" and "power of 2" in bad["message"]


# A provider standing in for a server whose import path raises an exception with no message (vLLM 0.34.0's
# UnspecifiedPlatform.get_device_name on a box without NVML: `raise NotImplementedError`)
SILENT_SERVER = """\
def get_device_name():
    raise NotImplementedError


def launches(spec):
    get_device_name()
    yield from ()
"""


def test_an_exception_without_a_message_is_named_where_the_server_raised_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "silent_server.py").write_text(SILENT_SERVER)
    monkeypatch.syspath_prepend(str(tmp_path))
    manifest = tmp_path / "m.toml"
    manifest.write_text(TOY.read_text().replace("prewarm_toy.provider", "silent_server"))
    for verb in (["plan", str(manifest)], ["build", str(manifest), "--cache-dir", str(tmp_path / "cache")]):
        assert main(verb) == ManifestError.exit_code, verb
        err = " ".join(capsys.readouterr().err.split())
        assert ("launches(spec) failed: NotImplementedError (no message), raised at silent_server.py:2 in "
                "get_device_name") in err, err
    # the build failed inside its lock: the lock file is gone with it
    assert not CacheDir(tmp_path / "cache").build_lock.exists()


def test_a_build_leaves_no_lock_file_whether_it_ends_or_fails(built, tmp_path):
    assert not CacheDir(built[0]).build_lock.exists()
    assert main(["build", str(FIXTURES / "toy-broken.toml"), "--cache-dir", str(tmp_path)]) == BuildError.exit_code
    assert not CacheDir(tmp_path).build_lock.exists()
    assert (tmp_path / META).is_dir()  # what the build wrote stays


def _hold_build_lock(root: str, inside: str) -> None:
    """In a child process: take the dir's build lock and, while holding it, claim ``inside`` exclusively."""
    with CacheDir(root).building():
        fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # FileExistsError: two holders at once
        time.sleep(0.05)
        os.close(fd)
        os.unlink(inside)


def test_the_build_lock_removed_at_each_release_still_admits_one_build_at_a_time(tmp_path):
    """Eight processes contend for one dir's build lock: each removes the lock file before releasing it, and no two
    hold it at once (a waiter that gets the removed file's lock takes the new file's instead)."""
    import multiprocessing

    (tmp_path / META).mkdir()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_hold_build_lock, args=(str(tmp_path), str(tmp_path / "inside"))) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 8
    assert not CacheDir(tmp_path).build_lock.exists()


def test_device_mode_without_a_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(EnvironmentProblem, match="no CUDA device visible"):
        build(TOY, tmp_path, mode="device")



def test_unknown_mode_is_a_clear_error(tmp_path):
    from prewarm.building.backends import get_target

    with pytest.raises(ManifestError, match="--mode: 'fast' is not one of offline, device, auto"):
        get_target("cuda", "sm_90", "fast")
    assert main(["build", str(tmp_path / "missing.toml"), "--cache-dir", str(tmp_path)]) == ManifestError.exit_code


def test_without_a_c_compiler_the_kernels_are_built_and_the_missing_launchers_said(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))  # what Triton's own build (and ours) would use
    report = build(TOY, tmp_path / "cache", workers=2, mode="offline")
    assert report.ok and report.count("compiled") == 11
    assert not list((tmp_path / "cache").rglob("*.so"))
    assert any("launchers and cuda_utils.so were not built" in n and "no-such-cc" in n for n in report.notes)
