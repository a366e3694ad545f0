"""The Triton release seam (prewarm.building.tritoncompat.releases): a Triton prewarm does not support is refused by
name before any work; and verify of a cache built under this environment's Triton (3.6 or 3.8: this file runs in both
CI environments) reports what it finds, never a traceback: the cache as built, a node whose libcuda.so.1 is elsewhere
than the build was told, entries removed and corrupted. 3.8 keys cuda_utils by the dirs libcuda.so.1 is found in;
3.6 does not, and builds a launcher per kernel signature instead."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prewarm_helpers import run_cli  # noqa: E402

from prewarm.building import tritoncompat  # noqa: E402
from prewarm.building.build import build  # noqa: E402
from prewarm.cli import main  # noqa: E402
from prewarm.errors import EnvironmentProblem, IntegrityError, WillMissError  # noqa: E402

BUILT_FOR = "/opt/node-driver/lib"  # the libcuda dir the manifest names: exists on no test host
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")]),
       "PREWARM_STORE": ""}


def test_a_triton_prewarm_does_not_support_is_refused_by_name_before_any_work(monkeypatch, capsys, tmp_path):
    from prewarm.building.tritoncompat import releases

    monkeypatch.setattr(releases, "triton_distribution", lambda: ("triton", "3.7.1"))
    releases.release.cache_clear()
    try:
        code = main(["build", str(FIXTURES / "toy-cuda.toml"), "--cache-dir", str(tmp_path / "cache")])
    finally:
        releases.release.cache_clear()
    assert code == EnvironmentProblem.exit_code
    err = capsys.readouterr().err
    assert "triton 3.7.1" in err and "supported: triton 3.6, triton 3.8" in err
    assert not (tmp_path / "cache").exists()  # refused before any work


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The toy manifest, told its nodes' libcuda.so.1 is in BUILT_FOR, built offline, packed and installed at
    another path (receipts: verify checks every byte)."""
    root = tmp_path_factory.mktemp("releases")
    manifest = root / "toy.toml"
    text = (FIXTURES / "toy-cuda.toml").read_text()
    manifest.write_text(text.replace('arch = "sm_90"\n', f'arch = "sm_90"\nlibcuda_dirs = ["{BUILT_FOR}"]\n', 1))
    report = build(manifest, root / "build", workers=2, mode="offline")
    assert report.ok, report.failed
    run_cli("pack", root / "build", "-o", root / "bundle", env=ENV)
    run_cli("install", root / "bundle", "--cache-dir", root / "node", env=ENV)
    return manifest, root / "node", report, root / "bundle"


def verify(manifest: Path, cache: Path, *flags: str, check: int, env: dict | None = None):
    p = run_cli("verify", "--cache-dir", cache, "--plan", manifest, *flags, env=env or ENV, check=check)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    return p.stdout


def test_build_says_what_it_built_for_the_first_launch(node):
    _, _, report, _ = node
    note = next(n for n in report.notes if n.startswith("C modules a node builds at first launch"))
    if tritoncompat.release().cuda_launchers == "generic":
        assert f"libcuda.so.1 is in {BUILT_FOR}" in note and "no launcher per kernel signature: not needed" in note
    else:
        assert "the launchers of 11 kernels" in note


def test_verify_of_the_cache_as_built_is_clean(node):
    manifest, cache, _, _ = node
    out = verify(manifest, cache, "--require-launchers", check=0)
    assert "11/11 planned compiles hit" in out and out.rstrip().splitlines()[-1].startswith("clean")
    if tritoncompat.release().cuda_launchers == "generic":  # no driver here: keyed as the manifest's nodes, and said
        assert "1 of 1 in the cache (cuda_utils, whose launch serves every kernel" in out


def test_a_node_whose_libcuda_is_elsewhere_is_told_both_dirs(node, tmp_path):
    manifest, cache, _, _ = node
    driver = tmp_path / "usr-lib"  # this node's driver dir (Triton asserts libcuda.so.1 is there)
    driver.mkdir()
    (driver / "libcuda.so.1").touch()
    env = {**ENV, "TRITON_LIBCUDA_PATH": str(driver)}
    if tritoncompat.release().cuda_launchers == "per-signature":  # 3.6 keys cuda_utils by source and platform only
        verify(manifest, cache, "--require-launchers", check=0, env=env)
        return
    out = verify(manifest, cache, check=0, env=env)  # informational: the node builds it at first launch
    assert "0 of 1 in the cache" in out
    assert f"built for libcuda.so.1 in {BUILT_FOR}" in out and f"finds it in {driver}" in out
    verify(manifest, cache, "--require-launchers", check=WillMissError.exit_code, env=env)


def test_removed_and_corrupted_entries_are_reported(node, tmp_path):
    manifest, _, report, bundle = node
    cache = tmp_path / "node"
    run_cli("install", bundle, "--cache-dir", cache, env=ENV)
    shutil.rmtree(cache / report.results[0].key)  # a kernel's entry removed
    utils = next(cache.rglob("cuda_utils*.so"))
    utils.write_bytes(b"not a shared object")  # the C module corrupted
    cubin = next(p for p in cache.rglob("*.cubin") if report.results[0].key not in str(p))
    cubin.write_bytes(cubin.read_bytes()[:-1])  # another kernel's binary cut short
    out = verify(manifest, cache, check=IntegrityError.exit_code)
    assert "PROBLEM" in out and "missing" in out and "modified" in out
    shutil.rmtree(utils.parent)  # the C module gone: will-hit still answers for every compile
    out = verify(manifest, cache, "--require-launchers", check=IntegrityError.exit_code)
    assert "10/11 planned compiles hit" in out and "MISS" in out and "absent" in out
