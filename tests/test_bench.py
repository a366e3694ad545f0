"""The GPU benches, as far as they run on this GPU-less box: none drives the planner's own calls, and each says
clearly why it cannot measure here (real install of a real bundle, real child processes) instead of a traceback or
a pretend figure."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prewarm.shipping.pack import pack

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
PLANNER = "prewarm_kernels.kda.serving"


def test_no_bench_drives_the_planners_call_builder():
    """A proof driven by the planner's own calls cannot see what the plan misses (issue 10): bench/ never imports
    the planner's provider module, nor calls its ``run`` / ``launches`` / ``_calls``."""
    offenders = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("kda.serving"):
                offenders.append(f"{path.name}:{node.lineno} from {node.module} import ...")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("kda") and \
                    any(a.name == "serving" for a in node.names):
                offenders.append(f"{path.name}:{node.lineno} from {node.module} import serving")
            elif isinstance(node, ast.Import) and any(a.name == PLANNER for a in node.names):
                offenders.append(f"{path.name}:{node.lineno} import {PLANNER}")
            elif isinstance(node, ast.Constant) and node.value == PLANNER:
                offenders.append(f"{path.name}:{node.lineno} names {PLANNER!r} (importlib?)")
            elif isinstance(node, ast.Attribute) and node.attr in ("launches", "_calls") and \
                    isinstance(node.value, ast.Name) and node.value.id == "serving":
                offenders.append(f"{path.name}:{node.lineno} serving.{node.attr}")
    assert not offenders, "bench/ drives the planner's call builder:\n" + "\n".join(offenders)
    assert not (BENCH / "serving_mix.py").exists()


def bench(script: str, *args: str, tmp: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES")}
    env["PREWARM_BENCH_WORK"] = str(tmp / "work")
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_serving_traffic_without_a_gpu_installs_then_reports_why_nothing_ran(triton_cache, tmp_path):
    """Real bundle, real `prewarm install` per seed into a fresh node dir, real measuring processes: each says it
    has no CUDA device; the JSON keeps every run with its reason; exit 1; node dirs are cleaned up."""
    bundle = tmp_path / "bundle"
    pack(triton_cache, bundle)
    out = tmp_path / "traffic.json"
    p = bench("serving_traffic.py", "--bundle", str(bundle), "--seeds", "3,4", "--expect-zero", "--out", str(out),
              "--work-dir", str(tmp_path / "work"), tmp=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert [(r["bundle"], r["seed"]) for r in doc["runs"]] == [("offline", 3), ("offline", 4)]
    for r in doc["runs"]:
        assert r["install_s"] > 0
        assert "no CUDA device visible" in r["error"]
    assert doc["bundles"]["offline"]["entries"] == 5 and doc["bundles"]["offline"]["autotune_results"] == 0
    assert doc["ok"] is False and doc["summary"]["offline"]["failed"] == 2
    assert not list((tmp_path / "work").glob("node-*"))
    assert "FAIL  offline: 0 of 2 processes ran" in p.stdout


def test_serving_traffic_refuses_a_dir_that_is_no_bundle(tmp_path):
    p = bench("serving_traffic.py", "--bundle", str(tmp_path), "--out", str(tmp_path / "x.json"), tmp=tmp_path)
    assert p.returncode == 1 and f"--bundle {tmp_path}: no index.json there" in p.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--seeds", "1,1"], "expected distinct seeds"),
    (["--seeds", "1,x"], "expected comma-separated integers"),
    (["--seeds", "1,2", "--device-runs", "3"], "--device-runs between 0 and the number of seeds"),
])
def test_serving_traffic_bad_options_exit_2(tmp_path, args, message):
    p = bench("serving_traffic.py", "--bundle", str(tmp_path), *args, tmp=tmp_path)
    assert p.returncode == 2 and message in p.stderr


def test_dp_stall_needs_one_gpu_per_rank(tmp_path):
    out = tmp_path / "dp.json"
    p = bench("dp_stall.py", "--out", str(out), "--work-dir", str(tmp_path / "work"), tmp=tmp_path)
    assert p.returncode == 1
    doc = json.loads(out.read_text())
    assert doc["error"] == "RuntimeError: --ranks 2: one GPU per rank, but 0 visible"
    assert doc["backend"] == "nccl" and doc["ok"] is False


def test_h200_proof_script_usage():
    for args in ([], ["traffic"], ["nonsense"]):
        p = subprocess.run(["bash", str(BENCH / "h200_proof.sh"), *args], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "OUT": "/nonexistent-never-written"})
        assert p.returncode == 2, args
        assert ("usage: bash bench/h200_proof.sh traffic BUNDLE | jit DIR | sglang-layer DIR | dp-stall [BUNDLE] | "
                "fla-tune | fla-offline | vllm-layer") in p.stderr


def test_offline_autotune_without_a_gpu_installs_verifies_then_reports_why_nothing_ran(triton_cache, tmp_path):
    """The proof bench of shipped autotune results: a real install and verify, then real processes started together
    and one after another; here each says it has no CUDA device, the JSON keeps every run with its group and
    reason, and the bench fails."""
    bundle = tmp_path / "bundle"
    pack(triton_cache, bundle)
    out = tmp_path / "offline_autotune.json"
    p = bench("offline_autotune.py", "--bundle", str(bundle), "--manifest", str(REPO / "tests/fixtures/toy-guard.toml"),
              "--together", "2", "--sequential", "1", "--out", str(out), "--work-dir", str(tmp_path / "work"),
              tmp=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert [r["group"] for r in doc["runs"]] == ["together", "together", "sequential"]
    assert all("no CUDA device visible" in r["error"] for r in doc["runs"])
    assert doc["first_step_limit_s"] == 1.0 and doc["ok"] is False
    assert "FAIL  0 of 3 processes ran" in p.stdout
