"""Build: every planned compile lands in the cache dir through the real JIT path, in worker processes; a second
build compiles nothing; failures carry the compiler's message and exit code 4; the build record is written."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.build import build, read_record  # noqa: E402
from prewarm.cli import main  # noqa: E402
from prewarm.errors import BuildError, EnvironmentProblem  # noqa: E402

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
    assert any("launcher" in n for n in report.notes)  # the offline caveat is said, not hidden


def test_build_record_lists_manifest_fingerprint_and_keys(built):
    cache, report, _ = built
    rec = read_record(cache)
    assert rec["manifest"]["name"] == "toy-cuda" and rec["manifest"]["digest"] == report.digest
    assert rec["fingerprint"]["triton.version"] == "3.6.0" and rec["fingerprint"]["target.arch"] == "sm_90"
    assert rec["target"] == {"backend": "cuda", "arch": "sm_90", "mode": "offline"}
    assert [(r["label"], r["key"]) for r in rec["requests"]] == [(r.label, r.key) for r in report.results]
    assert len({r["key"] for r in rec["requests"]}) == 11


def test_second_build_compiles_nothing(built, capsys):
    cache, report, _ = built
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if ".prewarm" not in p.parts}
    assert main(["build", str(TOY), "--cache-dir", str(cache), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["compiled"], doc["present"], doc["failed"]) == (0, 11, 0)
    assert [r["key"] for r in doc["results"]] == [r.key for r in report.results]
    after = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if ".prewarm" not in p.parts}
    assert after == before  # not a file touched


def test_failures_carry_the_compiler_message(tmp_path, capsys):
    code = main(["build", str(FIXTURES / "toy-broken.toml"), "--cache-dir", str(tmp_path), "--workers", "2",
                 "--json"])
    assert code == BuildError.exit_code == 4
    doc = json.loads(capsys.readouterr().out)
    assert (doc["compiled"], doc["failed"]) == (1, 1)
    (bad,) = [r for r in doc["results"] if r["status"] == "failed"]
    assert bad["label"] == "broken_kernel BLOCK=48" and "power of 2" in bad["message"]


def test_device_mode_without_a_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(EnvironmentProblem, match="no CUDA device visible"):
        build(TOY, tmp_path, mode="device")



def test_unknown_mode_is_a_clear_error(tmp_path):
    from prewarm.errors import ManifestError
    from prewarm.targets import get_target

    with pytest.raises(ManifestError, match="--mode: 'fast' is not one of offline, device, auto"):
        get_target("cuda", "sm_90", "fast")
    assert main(["build", str(tmp_path / "missing.toml"), "--cache-dir", str(tmp_path)]) == ManifestError.exit_code
