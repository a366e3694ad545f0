"""No benchmarking on an Ascend node (issue 40): a triton-ascend 3.2.0 process under `prewarm guard` calls each
autotuned kernel of the Ascend sglang deployment through its real Autotuner (sgl-kernel-npu's KDA gate, sglang's
cumsum with the log2-e scale, and chunk_kda_scaled_dot_kkt_fwd's inter and intra kernels, through their sglang /
sgl-kernel-npu entry points). With the shipped manifest (its `[target] tuned` table pins them) the guard counts 0
benchmarks and each kernel asks Triton for its pinned config alone; with the same manifest minus the table it
counts (and refuses, error mode) each Autotuner's benchmark. Stood in: the device (prewarm's offline NPU driver
with the A3 profile answering torch.npu's queries, as tests/ascend/test_guard_ascend.py) and the compiler (the
compile requests are captured, not compiled: plan's own capture), and sgl-kernel-npu's package __init__ (it loads
torch_npu and a native library: tests/fixtures/sgl_kernel_npu_standin, as .ci/setup assembles it; its kernel modules
are upstream's files)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ARCH, REPO, run_prewarm, write_manifest

from prewarm.node import fingerprint, metrics
from prewarm.shipping.cachedir import CacheDir

MANIFEST = REPO / "manifests" / "kimi-k3-ascend-a3-sglang.toml"
PINNED = {  # kernel -> the constexprs and options its pin gives its one compile request
    "sgl_kernel_npu.fla.kda_gate:_kda_gate_fwd_kernel": {"BT": 64, "num_warps": 4, "num_stages": 2},
    "sglang.kernels.ops.attention.fla.cumsum:chunk_local_cumsum_vector_kernel":
        {"BS": 64, "num_warps": 4, "num_stages": 3},
    "sglang.kernels.ops.attention.fla.kda:chunk_kda_scaled_dot_kkt_fwd_kernel_intra_sub_inter":
        {"BK": 64, "num_warps": 4, "num_stages": 3},
    "sglang.kernels.ops.attention.fla.kda:chunk_kda_scaled_dot_kkt_fwd_kernel_intra_sub_intra":
        {"num_warps": 4, "num_stages": 3},
}

APP = """
import json
import torch
from prewarm.building import tritoncompat
from prewarm.building.backends.npu import activate_offline
from prewarm.node.guard import UncoveredBenchmark

activate_offline({arch!r}, "A3")
from sgl_kernel_npu.fla.kda_gate import fused_kda_gate_npu
from sglang.kernels.ops.attention.fla.cumsum import chunk_local_cumsum
from sglang.kernels.ops.attention.fla.kda import chunk_kda_scaled_dot_kkt_fwd

T, H, K = 100, 6, 128  # one rank of K3 at attention-TP 16: 6 KDA heads of 128
cu = torch.tensor([0, 37, T], dtype=torch.int32)
q, k = (torch.randn(1, T, H, K, dtype=torch.bfloat16) for _ in range(2))
g, beta = torch.randn(1, T, H, K, dtype=torch.float32), torch.rand(1, T, H, dtype=torch.bfloat16)
calls = {{
    "gate": lambda: fused_kda_gate_npu(torch.randn(T, H * K, dtype=torch.bfloat16), torch.randn(H), K,
                                       gate_bias=torch.randn(H * K), lower_bound=-5.0),
    "cumsum": lambda: chunk_local_cumsum(g, chunk_size=64, scale=1.4426950408889634, cu_seqlens=cu),
    "kkt": lambda: chunk_kda_scaled_dot_kkt_fwd(q, k, gk=g, beta=beta, scale=K ** -0.5, cu_seqlens=cu),
}}
for name, call in calls.items():
    with tritoncompat.compile_requests(skip=True) as requests:  # the compiler stood in: requests, not compiles
        try:
            call()
            outcome = "ran"
        except UncoveredBenchmark as e:
            outcome = "refused: " + str(e)
    print(json.dumps({{"call": name, "outcome": outcome, "requests": [json.loads(r) for r in requests]}}), flush=True)
"""


def built_cache(path: Path) -> Path:
    """An empty cache dir as `prewarm build` leaves it (its build info): the guard refuses a server reading a dir no
    bundle was built or installed into."""
    cache = CacheDir(path)
    cache.meta.mkdir(parents=True)
    cache.write_build_info({"fingerprint": fingerprint.current("npu", ARCH)})
    return path


def guarded(tmp_path: Path, manifest: Path, name: str) -> tuple[list[dict], dict[str, float], str]:
    """(each call's outcome and compile requests, benchmarks per kernel as the guard counted them, stderr)."""
    app = tmp_path / f"{name}.py"
    app.write_text(APP.format(arch=ARCH))
    prom = tmp_path / f"{name}.prom"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREWARM_", "TRITON_"))
           and k not in fingerprint.ASCEND_CODEGEN_ENV}
    env["TRITON_CACHE_DIR"] = str(built_cache(tmp_path / f"{name}-cache"))
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", "guard", "--mode", "error", "--plan", manifest,
                        "--metrics-textfile", prom, "--", sys.executable, str(app)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    counts = metrics.read(str(prom))[0] if prom.exists() else {}
    calls = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]  # (triton-ascend's advice)
    return calls, counts.get(metrics.BENCHMARKS, {}), p.stderr


def test_with_the_shipped_table_no_autotuned_kernel_benchmarks_and_each_runs_its_pin(tmp_path):
    calls, benchmarks, stderr = guarded(tmp_path, MANIFEST, "pinned")
    assert [c["outcome"] for c in calls] == ["ran"] * 3, calls
    assert benchmarks == {}, stderr
    requests = [r for c in calls for r in c["requests"]]  # Triton's own compile requests, in call order
    assert [r["name"] for r in requests] == [k.split(":")[1] for k in PINNED], requests
    for r, pin in zip(requests, PINNED.values()):  # one each: its pinned config, constexprs and options
        assert {k: {**r["constants"], **r["options"]}[k] for k in pin} == pin, r["name"]


def test_without_the_table_the_guard_counts_and_refuses_each_benchmark(tmp_path):
    text = MANIFEST.read_text()
    untuned = tmp_path / "untuned.toml"
    untuned.write_text("\n".join(line for line in text.splitlines() if not line.startswith("tuned =")))
    calls, benchmarks, stderr = guarded(tmp_path, untuned, "untuned")
    # the kkt entry point stops at its first kernel (inter), so its intra kernel is not reached
    assert [c["outcome"].split(":")[0] for c in calls] == ["refused"] * 3, calls
    assert benchmarks == {kernel: 1.0 for kernel in list(PINNED)[:3]}, stderr
    assert "this Triton keeps no autotune results (triton-ascend 3.2: no cache_results)" in stderr, stderr
    assert "tuning key (6, 128, 'torch.bfloat16'" in stderr, stderr  # the gate's key: H, D, then tensor dtypes


PLANNED = """
    [[kernels]]
    function = "sglang.kernels.ops.attention.fla.cumsum:chunk_local_cumsum_vector_kernel"
    args = { s = {tensor = "float32"}, o = {tensor = "float32"}, scale = 1.4426950408889634, cu_seqlens = {tensor = "int32"}, chunk_indices = {tensor = "int32"}, T = 100, B = 1, H = 6, S = 128, BT = 64, REVERSE = false, HAS_SCALE = true, IS_VARLEN = true, HEAD_FIRST = false }

    [[kernels]]
    function = "sglang.kernels.ops.attention.fla.kda:chunk_kda_scaled_dot_kkt_fwd_kernel_intra_sub_intra"
    args = { q = {tensor = "bfloat16"}, k = {tensor = "bfloat16"}, g = {tensor = "float32"}, beta = {tensor = "bfloat16"}, A = {tensor = "float32"}, Aqk = {tensor = "float32"}, scale = 0.088, gk_scale = 1.0, cu_seqlens = {tensor = "int32"}, chunk_indices = {tensor = "int32"}, T = 100, H = 6, K = 128, BT = 64, BC = 16, BK = 128, IS_VARLEN = true }
"""


def planned_manifest(path: Path, tuned: str | None) -> Path:
    """A manifest planning PLANNED's calls on the A3, with ``tuned`` as its autotune table (None: none)."""
    manifest = write_manifest(path, PLANNED)
    target = 'device = "A3"\n' + (f'tuned = "{tuned}"\n' if tuned else "")
    manifest.write_text(manifest.read_text().replace(f'arch = "{ARCH}"\n', f'arch = "{ARCH}"\n{target}'))
    return manifest


WILL_HIT = """
import json, sys
from prewarm.node.willhit import check
for manifest in sys.argv[2:]:
    r = check(manifest, sys.argv[1], mode="offline")  # what verify --plan computes, for the offline target
    print(json.dumps({"compiles": len(r.results), "autotune": [a.to_json() for a in r.autotune]}), flush=True)
"""


def test_plan_and_verify_name_each_pinned_kernel_and_each_that_would_benchmark(tmp_path):
    """The plan narrows a pinned kernel's calls to its pin, and says so; verify --plan's will-hit has one row per
    autotuned kernel: pinned (the config), or absent (the node benchmarks its N configs in every process)."""
    pinned = planned_manifest(tmp_path / "pinned.toml", str(MANIFEST.with_name(f"{MANIFEST.stem}.tuned.toml")))
    untuned = planned_manifest(tmp_path / "untuned.toml", None)
    p = run_prewarm("plan", pinned)
    assert p.returncode == 0, p.stderr[-3000:]
    text = " ".join(p.stdout.split())
    assert ("pinned sglang.kernels.ops.attention.fla.cumsum:chunk_local_cumsum_vector_kernel: runs BS=64 num_warps=4 "
            "num_stages=3 alone under the guard (not one of its 6 configs; user report's validated A3 pins): 6 configs "
            "not planned") in text, text
    assert "pin unused sgl_kernel_npu.fla.kda_gate:_kda_gate_fwd_kernel" in text, text  # (no call of it here)
    cache = built_cache(tmp_path / "cache")
    p = subprocess.run([sys.executable, "-c", WILL_HIT, str(cache), str(pinned), str(untuned)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    with_pins, without = (json.loads(line) for line in p.stdout.splitlines() if line.startswith("{"))
    assert (with_pins["compiles"], without["compiles"]) == (2, 6 + 4)
    rows = {a["kernel"].split(":")[1]: (a["present"], a["configs"], a["pinned"]) for a in with_pins["autotune"]}
    assert rows == {"chunk_local_cumsum_vector_kernel": (True, 6, "BS=64 num_warps=4 num_stages=3"),
                    "chunk_kda_scaled_dot_kkt_fwd_kernel_intra_sub_intra": (True, 4, "num_warps=4 num_stages=3")}
    assert [(a["present"], a["configs"]) for a in without["autotune"]] == [(False, 6), (False, 4)]
    assert "the node benchmarks its 6 configs at the first call of each tuning key, in every process" in (
        without["autotune"][0]["detail"])


def test_a_pin_that_does_not_fit_its_kernel_is_refused_naming_the_row(tmp_path):
    """A pin setting other meta-parameters than the kernel's configs would launch it without one (or with one it
    does not have): plan refuses it (exit 3), naming the kernel, the device and what its configs set."""
    table = tmp_path / "t.tuned.toml"
    table.write_text('[[pinned]]\ndevice = "Ascend910_9391"\n'
                     'kernel = "sglang.kernels.ops.attention.fla.cumsum:chunk_local_cumsum_vector_kernel"\n'
                     'config = { BK = 64, num_warps = 4 }\nsource = "a typo"\n')
    p = run_prewarm("plan", planned_manifest(tmp_path / "m.toml", "t.tuned.toml"))
    assert p.returncode == 3, p.stderr[-3000:]
    assert ("autotune pin of sglang.kernels.ops.attention.fla.cumsum:chunk_local_cumsum_vector_kernel for "
            "Ascend910_9391 ({'BK': 64, 'num_warps': 4}): sets meta-parameters ['BK'], but the kernel's configs set "
            "['BS']") in " ".join(p.stderr.split()), p.stderr
