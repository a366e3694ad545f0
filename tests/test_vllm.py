"""vLLM 0.34.0's own KDA kernels (``prewarm.providers.vllm.kda``) planned for the H200 from the wheel's real kernel
files (``build/vllm``, assembled by ``.ci/setup``), checked against independent traffic
(``traffic.vllm_kda``: written from vLLM's Kimi-Linear layer, not from the provider) run through vLLM's
own wrappers on fake tensors, compared by the key Triton computes for each request (``prewarm.building.probe.planned_keys``).
No build: keys need none. No H200 recording of vLLM exists yet (README, Known limits).
"""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from traffic.closure import fresh_seed
from prewarm.building import tritoncompat
from prewarm.building.backends import get_target
from prewarm.planning.manifest import load
from prewarm.planning.plan import Compile, plan_for
from prewarm.building.probe import planned_keys
from prewarm.providers.vllm import kda as vllm_kda
from traffic import vllm_kda as vllm_traffic
from prewarm.providers.capture import as_meta, launches_of
from prewarm_kernels.spec import SpecError

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "kimi-linear-h200-vllm.toml"
CALLS_PER_SEED = 60


@pytest.fixture(scope="module")
def planned():
    """The shipped manifest planned under the H200 profile, and the key of each compile (conftest puts torch.cuda
    and Triton's driver back after the module)."""
    m = load(MANIFEST)
    p = plan_for(m, get_target("cuda", "sm_90", "offline", "H200"))
    return m, p, planned_keys(p.compiles)


def test_the_kernels_are_the_wheels_own(planned):
    """The provider drives the files of the vLLM wheel byte for byte (build/vllm), not a copy of ours."""
    import vllm.models.kimi_k3.nvidia.ops.third_party.kda.chunk as chunk

    import importlib.util
    import zipfile

    where = importlib.util.spec_from_file_location("vllm_assemble", REPO / "tests/fixtures/vllm_standin/assemble.py")
    assemble = importlib.util.module_from_spec(where)
    where.loader.exec_module(assemble)
    KERNEL_MODULES = assemble.KERNEL_MODULES
    root = Path(chunk.__file__).resolve().parents[7]
    assert root == REPO / "build" / "vllm"
    (wheel,) = (REPO / "build" / "wheels").glob("vllm-0.34.0-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".py") and any(
            n == m or (m.endswith("/") and n.startswith(m)) for m in KERNEL_MODULES)]
        assert len(names) > 15 and all((root / n).read_bytes() == zf.read(n) for n in names)
    assert not (REPO / "tests" / "fixtures" / "vllm_standin" / "vllm" / "models").exists()


def test_the_api_table_accounts_for_every_parameter_of_vllms_entry_points(planned):
    """Each entry point the Kimi-Linear layer calls, read from the installed vLLM: a parameter vLLM adds (a new
    constexpr, pointer or switch) fails here until the provider says how it plans it."""
    import vllm.models.kimi_k3.nvidia.ops.third_party.kda as kda

    for name, table in vllm_kda.API.items():
        params = list(inspect.signature(getattr(kda, name)).parameters)
        assert set(params) == set(table), (name, sorted(set(params) ^ set(table)))
    # the package's public functions: a new entry point is noticed too
    assert set(kda.__all__) == {*vllm_kda.API, "chunk_kda", "chunk_kda_fwd", "chunk_kda_with_fused_gate_fwd",
                                "fused_kda_gate", "fused_kda_gate_chunk_cumsum", "fused_recurrent_kda_fwd"}


def runtime_compiles(calls) -> dict[str, Compile]:
    """Every compile request the calls make, by Triton's own JIT binding of each captured launch on meta tensors."""
    out: dict[str, Compile] = {}
    with vllm_kda.fake_cuda():
        for call in calls:
            for launch in launches_of(call.run):
                args = tuple(as_meta(a) for a in launch.args)
                kwargs = {k: as_meta(v) for k, v in launch.kwargs.items()}
                with tritoncompat.compile_requests(skip=True) as captured:
                    tritoncompat.warmup(launch.kernel, args, kwargs, grid=(1,))
                ref = tritoncompat.kernel_ref(launch.kernel)
                for data in captured:
                    out.setdefault(data, Compile("runtime", ref, f"{call.label} -> {ref.split(':')[1]}", data))
    return out


def not_planned(compiles: list[Compile], planned) -> str:
    from prewarm.node.explain import explain

    _, p, keys = planned
    missing = [c for key, c in planned_keys(compiles).items() if key not in keys]
    return "\n".join(f"{c.label}\n  {explain(c.specialization, p.compiles, kernel=c.kernel)}" for c in missing[:8])


@pytest.mark.parametrize("seed", [0, fresh_seed()], ids=lambda s: f"seed{s}")
def test_independent_traffic_requests_nothing_the_plan_lacks(planned, seed):
    m, _, _ = planned
    calls = list(vllm_traffic.calls(m.spec(), seed, CALLS_PER_SEED, "cuda"))
    compiles = runtime_compiles(calls)
    missing = not_planned(list(compiles.values()), planned)
    assert not missing, f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): not planned:\n{missing}"
    assert {c.options["kind"] for c in calls} >= {"prefill", "decode", "spec"} and len(compiles) > 20


def test_each_index_pointer_is_planned_in_each_dtype_independently(planned):
    """vLLM builds its index tensors int32, a caller may hand int64 for any one of them: the verify kernel is planned
    with every combination of cu_seqlens, state-index and num_accepted_tokens dtypes."""
    _, p, _ = planned
    combos = set()
    for c in p.compiles:
        if c.kernel.endswith(":fused_recurrent_kda_fwd_kernel"):
            args = tritoncompat.parse_specialization(c.specialization).args
            combos.add(tuple(args[n].type for n in ("cu_seqlens", "state_indices", "num_accepted_tokens")))
    assert combos == {(a, b, c) for a in ("*i32", "*i64") for b in ("*i32", "*i64") for c in ("*i32", "*i64")}


def test_the_plan_makes_the_h200s_host_decisions(planned):
    """What vLLM derives from the device is the node's: programmatic dependent launch (capability 9: launch_pdl),
    the tf32 triangular solve (capability >= 8.0)."""
    _, p, _ = planned
    by_kernel: dict[str, list] = {}
    for c in p.compiles:
        by_kernel.setdefault(c.kernel.split(":")[1], []).append(tritoncompat.parse_specialization(c.specialization))
    assert all(s.args["launch_pdl"].value is True for s in by_kernel["fused_recurrent_kda_packed_decode_kernel"])
    assert {s.args["SOLVE_TRIL_DOT_PRECISION"].value for s in by_kernel["chunk_kda_fwd_kernel_inter_solve_fused"]} \
        == {"tf32"}


@pytest.mark.parametrize("change,key", [
    ({"vllm": {"paths": ["prefill", "extend"]}}, "vllm.paths"),
    ({"vllm": {"beta_row_strides": [8]}}, "vllm.beta_row_strides"),
    ({"vllm": {"state_slot_strides": [100]}}, "vllm.state_slot_strides"),
    ({"vllm": {"ring": 16}}, "vllm.ring"),
    ({"serving": {"qk_l2norm": False, "decode_batch_buckets": [1]}}, "serving.qk_l2norm"),
    ({"serving": {}}, "serving.decode_batch_buckets"),
])
def test_a_spec_vllm_cannot_serve_is_refused_naming_the_key(change, key):
    spec = {"backend": "cuda", "model": {"kda_heads": 32, "head_k_dim": 128, "head_v_dim": 128},
            "serving": {"decode_batch_buckets": [1]}}
    with pytest.raises(SpecError) as e:
        vllm_kda.read_spec({**spec, **change})
    assert e.value.key == key


def test_what_the_shipped_manifest_narrows_is_said():
    rows = {r["key"]: r for r in vllm_kda.options(load(MANIFEST).spec())}
    assert rows["spec.dtypes.index"]["planned"] == ["int32", "int64"] and not rows["spec.dtypes.index"]["narrowed"]
    assert rows["spec.dtypes.beta"]["narrowed"] and rows["spec.dtypes.beta"]["given"]
    assert rows["spec.vllm.recoverssm"]["narrowed"] and not rows["spec.vllm.recoverssm"]["given"]


def test_the_bench_drives_independent_traffic_and_without_a_gpu_says_why_nothing_ran(triton_cache, tmp_path):
    """bench/vllm_traffic.py never imports the provider; here (no GPU) it installs the bundle for real, its measuring
    process says it has no CUDA device, and the JSON keeps the run and the coverage still to be seen."""
    import ast
    import json
    import os
    import subprocess
    import sys

    from prewarm.shipping.pack import pack

    script = REPO / "bench" / "vllm_traffic.py"
    imports = {n.module for n in ast.walk(ast.parse(script.read_text())) if isinstance(n, ast.ImportFrom)}
    assert "traffic.vllm_kda" in imports and not any("providers.vllm" in (m or "") for m in imports)
    pack(triton_cache, tmp_path / "bundle")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES")}

    def bench(vllm_path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), "--bundle", str(tmp_path / "bundle"), "--seeds", "3",
                               "--vllm-path", str(vllm_path), "--out", str(tmp_path / "vt.json"), "--work-dir",
                               str(tmp_path / "work")], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    refused = bench(tmp_path)
    assert refused.returncode == 2 and f"--vllm-path {tmp_path}: no vllm package there" in refused.stderr
    assert not (tmp_path / "vt.json").exists()
    done = bench(REPO / "build" / "vllm")
    assert done.returncode == 1, done.stdout + done.stderr
    doc = json.loads((tmp_path / "vt.json").read_text())
    assert [r["seed"] for r in doc["runs"]] == [3] and "no CUDA device visible" in doc["runs"][0]["error"]
    assert doc["runs"][0]["install_s"] > 0 and not list((tmp_path / "work").glob("vllm/node-*"))
    cov, spec = doc["coverage"], load(MANIFEST).spec()
    most = vllm_kda.read_spec(spec).max_batch
    assert most > cov["largest_capture_size"] == max(spec["serving"]["decode_batch_buckets"])  # eager batches
    assert cov["decode_batch_sizes_past_capture"] == {"seen": 0, "of": most - cov["largest_capture_size"]}
    assert cov["missed"] == {"decode_batch_sizes": list(range(1, most + 1)), "odd_prefill_lengths": "none seen",
                             "index_dtypes": {p: ["int32", "int64"] for p in (
                                 "query_start_loc", "state_indices", "spec_query_start_loc", "spec_state_indices",
                                 "num_accepted_tokens")},
                             "paths": ["decode", "prefill", "spec_verify"]}


def test_the_shipped_h200_table_covers_every_planned_tuning_key(planned):
    """An offline bundle's autotune results come from the shipped table (vLLM's workers read them: `import vllm`
    sets TRITON_CACHE_AUTOTUNING=1): a kernel change that moves a tuning key leaves rows unused and every node
    benchmarks again at its first step. When this fails, re-run `prewarm tune manifests/kimi-linear-h200-vllm.toml
    -o manifests/kimi-linear-h200-vllm.tuned.toml` on an H200."""
    from prewarm_helpers import shipped_table_statuses

    m, p, _ = planned
    statuses = shipped_table_statuses(m, p.requests)
    assert set(statuses) == {"in table"} and len(statuses["in table"]) == 12, statuses


def test_an_offline_build_of_the_decode_path_verifies_clean(tmp_path):
    """The shipped manifest narrowed to vLLM's packed decode at the dense slot stride, built with the real `prewarm
    build` (no GPU: the offline target, the shipped table written as Triton's result files) and checked with `prewarm
    verify --plan` as the pre-launch job runs it (TRITON_CACHE_AUTOTUNING=1, as vLLM's own import sets it): every
    planned compile, kept autotune result and C module found, clean. (The whole manifest, 249 compiles, took 169 s
    here with 2 workers and verified clean the same way: README.)"""
    import os
    import subprocess
    import sys

    text = MANIFEST.read_text()
    narrowed = (text.replace('paths = ["prefill", "decode", "spec_verify"]', 'paths = ["decode"]')
                .replace("state_slot_strides = [524288, 561152, 589824]", "state_slot_strides = [524288]")
                .replace('index = ["int32", "int64"]', 'index = ["int32"]')
                .replace("\nmoe_", "\n# moe_").replace("\nvocab_size =", "\n# vocab_size =")
                .replace("\nmax_model_len =", "\n# max_model_len =")  # the layer only: no MoE, no runner
                .replace('tuned = "kimi-linear-h200-vllm.tuned.toml"', f'tuned = "{MANIFEST.with_suffix(".tuned.toml")}"'))
    assert narrowed.count("\n") == text.count("\n") and narrowed != text
    manifest = tmp_path / "decode.toml"
    manifest.write_text(narrowed)
    env = {**os.environ, "TRITON_CACHE_AUTOTUNING": "1"}
    env.pop("TRITON_CACHE_DIR", None)
    cli = [sys.executable, "-m", "prewarm.cli"]
    built = subprocess.run([*cli, "build", str(manifest), "--cache-dir", str(tmp_path / "c"), "--workers", "2"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0 and " 0 failed" in built.stdout, built.stdout + built.stderr
    verified = subprocess.run([*cli, "verify", "--cache-dir", str(tmp_path / "c"), "--plan", str(manifest)],
                              env=env, capture_output=True, text=True, timeout=600)
    assert verified.returncode == 0 and verified.stdout.rstrip().endswith("clean"), verified.stdout + verified.stderr
    assert "will-hit      ok" in verified.stdout and "C modules     ok" in verified.stdout
