"""record -> build -> rerun: every compile request a command makes (child processes included) is logged; a
manifest including the log builds exactly the cache the command itself produced."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.building.build import build  # noqa: E402
from prewarm.cli import main  # noqa: E402
from prewarm.errors import ManifestError  # noqa: E402
from prewarm.node.willhit import check  # noqa: E402

MANIFEST = """
[target]
backend = "cuda"
arch = "sm_90"

[[kernels]]
record = "app.jsonl"
"""


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rec")
    app_cache = tmp / "app-cache"
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "TRITON_CACHE_DIR")}
    os.environ["PYTHONPATH"] = str(FIXTURES)  # the recorded command imports the toy kernels
    os.environ["TRITON_CACHE_DIR"] = str(app_cache)
    try:
        code = main(["record", "-o", str(tmp / "app.jsonl"), "--", sys.executable, "-m", "prewarm_toy.record_app"])
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    assert code == 0
    (tmp / "m.toml").write_text(MANIFEST)
    return tmp, app_cache


def test_every_request_of_every_process_is_logged(recorded):
    tmp, _ = recorded
    lines = [json.loads(line) for line in (tmp / "app.jsonl").read_text().splitlines()]
    kernels = ["prewarm_toy.kernels:decode_kernel"] * 2 + ["prewarm_toy.kernels:add_kernel"] * 2
    assert [e["kernel"] for e in lines] == kernels
    assert len({e["pid"] for e in lines}) == 3  # the child processes were hooked too
    assert json.loads(lines[3]["specialization_data"])["name"] == "prewarm_toy.kernels.add_kernel"


def test_build_from_the_record_reproduces_the_commands_cache(recorded):
    tmp, app_cache = recorded
    cache = tmp / "built"
    report = build(tmp / "m.toml", cache, workers=2, mode="offline")
    assert report.requests == 3 and report.count("compiled") == 3 and report.ok  # the repeat is deduplicated
    assert sorted(r.label for r in report.results) == [
        "add_kernel [BLOCK=256 warps=4 stages=3]", "decode_kernel [HEADS=2 T=16 warps=4 stages=3]",
        "decode_kernel [HEADS=2 T=8 warps=4 stages=3]"]
    # the same key dirs the recorded command compiled into its own cache: a rerun on this cache compiles nothing
    assert sorted(r.key for r in report.results) == sorted(p.name for p in app_cache.iterdir())
    assert check(str(tmp / "m.toml"), str(cache)).ok


def test_the_commands_exit_code_is_returned(tmp_path, capsys):
    code = main(["record", "-o", str(tmp_path / "r.jsonl"), "--json", "--", sys.executable, "-c",
                 "raise SystemExit(3)"])
    assert code == 3
    assert json.loads(capsys.readouterr().out) == {"output": str(tmp_path / "r.jsonl"), "returncode": 3, "lines": 0,
                                                   "unique": 0}


def test_no_command_is_an_error(tmp_path):
    assert main(["record", "-o", str(tmp_path / "r.jsonl")]) == ManifestError.exit_code


def test_a_command_that_probes_for_triton_first_is_still_recorded(tmp_path, monkeypatch):
    """torch and fla call ``importlib.util.find_spec("triton")`` before importing it: the hook must survive that."""
    out = tmp_path / "probed.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    probe_then_run = ("import importlib.util, runpy; assert importlib.util.find_spec('triton'); "
                      "runpy.run_module('prewarm_toy.record_app', run_name='__main__')")
    assert main(["record", "-o", str(out), "--", sys.executable, "-c", probe_then_run]) == 0
    kernels = [json.loads(line)["kernel"] for line in out.read_text().splitlines()]
    assert kernels.count("prewarm_toy.kernels:decode_kernel") == 2 and "prewarm_toy.kernels:add_kernel" in kernels
