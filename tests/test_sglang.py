"""sglang 0.5.23's own KDA kernels (``prewarm.providers.sglang.cuda``) planned for the H200, checked against what
sglang really compiles: the 80 compile requests a real H200 process made (``prewarm record`` around sglang's
``TritonKDAKernel``), and independent traffic (``traffic.sglang_cuda``: written from sglang's backend
and model, not from the provider) run through sglang's own wrappers on fake tensors. Both compare by the key Triton
computes for each request (``prewarm.building.probe.planned_keys``), the key the node's runtime looks up. No build: keys need
none.
"""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from traffic.closure import fresh_seed
from prewarm.building import tritoncompat
from prewarm.building.backends import get_target
from prewarm.jit import JitRequest
from prewarm.planning.manifest import load
from prewarm.planning.plan import Compile, expand_all, load_record, plan_for
from prewarm.building.probe import planned_keys
from prewarm.providers import capture
from prewarm.providers.sglang import common as sglang_env, cuda as sglang_kda
from traffic import sglang_cuda as sglang_traffic
from prewarm_kernels.spec import SpecError

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "kimi-linear-h200-sglang.toml"
RECORDING = REPO / "tests" / "fixtures" / "sglang-0.5.23-kda-h200-record.jsonl"  # `prewarm record`, on the H200
CALLS_PER_SEED = 100


@pytest.fixture(scope="module")
def planned():
    """The shipped manifest planned here under the H200 profile, and the key of each compile (conftest puts
    torch.cuda and Triton's driver back after the module)."""
    m = load(MANIFEST)
    p = plan_for(m, get_target("cuda", "sm_90", "offline", "H200"))
    return m, p, planned_keys(p.compiles)


def runtime_compiles(spec: dict, calls) -> tuple[dict[str, Compile], list]:
    """Every compile request the calls make (specialization data -> Compile), by Triton's own JIT binding of each
    captured launch on meta tensors of the launch's layout, and the sglang JIT modules the calls loaded (sglang's own
    ``load_jit`` resolved each: prewarm.jit.JitRequest)."""
    out: dict[str, Compile] = {}
    with sglang_env.fake_device("cuda") as state:
        for call in calls:
            for launch in capture.launches_of(call.run):
                args = tuple(capture.as_meta(a) for a in launch.args)
                kwargs = {k: capture.as_meta(v) for k, v in launch.kwargs.items()}
                with tritoncompat.compile_requests(skip=True) as captured:
                    tritoncompat.warmup(launch.kernel, args, kwargs, grid=(1,))
                ref = tritoncompat.kernel_ref(launch.kernel)
                for data in captured:
                    out.setdefault(data, Compile("runtime", ref, f"{call.label} -> {ref.split(':')[1]}", data))
    return out, state.jit


def not_planned(compiles: list[Compile], planned) -> str:
    """The compiles whose key the plan lacks, each with the nearest planned compile and what differs ('' if none)."""
    from prewarm.node.explain import explain

    _, p, keys = planned
    missing = [c for key, c in planned_keys(compiles).items() if key not in keys]
    return "\n".join(f"{c.label}\n  {explain(c.specialization, p.compiles, kernel=c.kernel)}" for c in missing[:8])


def test_the_shipped_h200_table_covers_every_planned_tuning_key(planned):
    """The offline bundle's autotune results come from the shipped table (see test_plan's test of the same name):
    every planned tuning key has its row, measured over the configs the Autotuner benchmarks now."""
    from prewarm_helpers import shipped_table_statuses

    m, p, _ = planned
    statuses = shipped_table_statuses(m, p.requests)
    assert set(statuses) == {"in table"}, {k: v[:3] for k, v in statuses.items() if k != "in table"}


def test_every_request_sglang_made_on_the_h200_is_planned(planned):
    """The real server's data, not ours: each of the 80 requests recorded around sglang's TritonKDAKernel on the H200
    (prefill, packed decode, decode, verify at four token buckets) has its key in the plan."""
    recorded = expand_all(load_record(str(RECORDING)))
    assert len(recorded) == 80
    missing = not_planned(recorded, planned)
    assert not missing, f"recorded on the H200, not planned:\n{missing}"


@pytest.mark.parametrize("seed", [0, 1, fresh_seed()], ids=lambda s: f"seed{s}")
def test_independent_traffic_requests_nothing_the_plan_lacks(planned, seed):
    m, _, _ = planned
    calls = list(sglang_traffic.calls(m.spec(), seed, CALLS_PER_SEED, "cuda"))
    compiles, jit = runtime_compiles(m.spec(), calls)
    missing = not_planned(list(compiles.values()), planned)
    assert not missing, f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): not planned:\n{missing}"
    kinds = {c.options["kind"] for c in calls}
    assert kinds == {"extend", "packed_decode", "decode", "target_verify"} and len(compiles) > 50
    # packed decode batches of 8+ with sglang's own dtypes load its CUDA JIT module: every module the traffic's calls
    # made sglang resolve (its name spells the template arguments) is one the plan builds
    _, p, _ = planned
    assert any(j.name.startswith("sgl_kernel_jit_kda_packed_decode") for j in jit), jit
    unplanned = sorted({j.name for j in jit} - {j.name for j in p.jit if j.library == "sglang"})
    assert not unplanned, f"seed {seed}: sglang JIT modules reached, not planned: {unplanned}"


def test_the_plan_makes_the_h200s_host_decisions(planned):
    """What sglang derives from the device is the node's: the recurrent kernel's grid layout (SPLIT_N_HV_GRID from
    q.device.type == "cuda"), programmatic dependent launch (Hopper: USE_GDC, launch_pdl), the K3 static config of
    the w/u recompute (capability 9.0), Triton's packed-decode kernel for batches the JIT kernel does not take."""
    _, p, _ = planned
    by_kernel: dict[str, list] = {}
    for c in p.compiles:
        by_kernel.setdefault(c.kernel.split(":")[1], []).append(tritoncompat.parse_specialization(c.specialization))
    recurrent = by_kernel["fused_sigmoid_gating_delta_rule_update_kernel"]
    assert all(s.args["SPLIT_N_HV_GRID"].value is True and s.args["USE_GDC"].value is True
               and s.options["launch_pdl"] is True for s in recurrent)
    assert {s.args["NP2_T"].value for s in recurrent} == {1 << k for k in range(10)}  # tokens up to 128 x 4
    assert "recompute_w_u_fwd_kernel" not in {c.kernel for c in p.compiles}  # autotuned variant unused on sm_90
    assert {(s.options["num_warps"], s.args["BK"].value) for s in by_kernel["_recompute_w_u_fwd_kernel"]} == {(8, 128)}
    assert by_kernel["fused_recurrent_kda_packed_decode_kernel"]


def test_every_batch_size_compiles_nothing_the_standing_sizes_do_not(planned, monkeypatch):
    """batch_sizes() stands for 1..max: planning every size (decode, packed decode, dense and ragged verify; a
    largest batch that is no power of two) makes no compile the standing sizes do not."""
    spec = {**planned[0].spec(), "sglang": {"paths": ["packed_decode", "decode", "target_verify"],
                                            "beta_row_strides": [32], "eagle_tree": False, "mamba_pool_slots": 257}}
    spec["dtypes"] = {**spec["dtypes"], "beta": "bfloat16", "gate_params": "float32"}
    spec["serving"] = {**spec["serving"], "draft_widths": [3], "max_running_requests": 100,
                       "decode_batch_buckets": [1, 8]}
    standing = sglang_kda.launches(spec)
    monkeypatch.setattr(sglang_kda, "batch_sizes", lambda most: list(range(1, most + 1)))
    every = sglang_kda.launches(spec)
    assert len(every) > 5 * len(standing)  # every size of 1..100 was called
    assert {c.specialization for c in _expanded(every)} == {c.specialization for c in _expanded(standing)}


def _expanded(launches) -> list[Compile]:
    from prewarm.planning.plan import Request, _encode, _ref_for

    requests = {}
    for launch in launches:
        if isinstance(launch, JitRequest):  # a module past Triton the calls reach: no Triton compile
            continue
        r = Request(_ref_for(launch.kernel, "test"), launch.label, "test", tuple(_encode(a, "") for a in launch.args),
                    {k: _encode(v, "") for k, v in launch.kwargs.items()})
        requests.setdefault(r.ident, r)
    return expand_all(list(requests.values()))


def test_chunk_counting_on_a_fake_device_is_sglangs_own():
    """chunk_kda counts chunks on the host (cu_seqlens.tolist()): on a fake device sglang's own function answers
    from the values index_tensor keeps, with the result it gives on real tensors; a fake cu_seqlens without values
    is refused, naming what to use."""
    import torch
    from sglang.kernels.ops.attention.fla import index

    rng = random.Random(5)
    for _ in range(20):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        cu = [0, *(sum(lengths[:i + 1]) for i in range(len(lengths)))]
        for dtype in (torch.int32, torch.int64):
            real = index.prepare_chunk_indices(torch.tensor(cu, dtype=dtype), 64)
            with sglang_env.fake_device("cuda"):
                fake = index.prepare_chunk_indices(capture.index_tensor(cu, dtype, "cuda"), 64)
            assert (tuple(fake.shape), fake.dtype, fake.device.type) == (tuple(real.shape), real.dtype, "cuda")
    with sglang_env.fake_device("cuda"), pytest.raises(ValueError, match="capture.index_tensor"):
        index.prepare_chunk_indices(torch.zeros(3, dtype=torch.int32, device="cuda"), 64)


@pytest.mark.parametrize("heads,tokens,seqs", [(32, 32768, 128), (32, 4096, 8), (6, 16384, 64), (2, 8192, 3),
                                               (1, 100, 2)])
def test_one_prefill_per_small_grid_and_nt_bucket_pair_the_budget_reaches(heads, tokens, seqs):
    layouts = sglang_kda.prefill_layouts(heads, tokens, seqs)
    pairs = set()
    for _, lengths in layouts:
        chunks = sum(-(-n // 64) for n in lengths)
        assert sum(lengths) <= tokens and len(lengths) <= seqs
        pairs.add((chunks * heads <= 256, (chunks > 32) + (chunks > 128)))
    most = min(seqs, tokens) + (tokens - min(seqs, tokens)) // 64  # every chunk count 1..most is reachable
    reachable = {(c * heads <= 256, (c > 32) + (c > 128)) for c in range(1, most + 1)}
    assert pairs == reachable and len(layouts) == len(reachable)


@pytest.mark.parametrize("change,key", [
    ({"serving": {"decode_batch_buckets": [1], "final_state": [True]}}, "serving.final_state"),
    ({"sglang": {"paths": ["extend", "verify"]}}, "sglang.paths"),
    ({"sglang": {"beta_row_strides": [8]}}, "sglang.beta_row_strides"),
    ({"sglang": {"ring": 16}}, "sglang.ring"),
    ({"serving": {"qk_l2norm": False, "decode_batch_buckets": [1]}}, "serving.qk_l2norm"),
    ({"serving": {}}, "serving.max_running_requests"),
])
def test_a_spec_sglang_cannot_serve_is_refused_naming_the_key(change, key):
    spec = {"backend": "cuda", "model": {"kda_heads": 32, "head_k_dim": 128, "head_v_dim": 128},
            "serving": {"decode_batch_buckets": [1]}}
    with pytest.raises(SpecError) as e:
        sglang_env.read_spec({**spec, **change})
    assert e.value.key == key


def test_plan_names_the_bad_key_and_the_manifest(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(MANIFEST.read_text().replace('paths = ["extend", "packed_decode", "decode", "target_verify"]',
                                                'paths = ["extend", "prefill"]'))
    done = subprocess.run([sys.executable, "-m", "prewarm.cli", "plan", str(bad)], capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode == 3 and "bad.toml" in done.stderr and "spec.sglang.paths" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_what_the_shipped_manifest_narrows_is_said():
    """Every axis planned on fewer values than sglang accepts is listed (``prewarm plan`` prints them): the index
    dtype the manifest narrows, the options no manifest can plan here (ReplaySSM, the prefill CUDA graph)."""
    rows = {r["key"]: r for r in sglang_kda.options(load(MANIFEST).spec())}
    assert rows["spec.dtypes.index"] == {"key": "spec.dtypes.index", "planned": ["int32"],
                                         "accepted": ["int32", "int64"], "given": True, "narrowed": True}
    assert rows["spec.sglang.replayssm"]["narrowed"] and not rows["spec.sglang.replayssm"]["given"]
    assert not rows["spec.sglang.paths"]["narrowed"] and rows["spec.dtypes.gate_params"]["planned"] == ["bfloat16",
                                                                                                        "float32"]


def test_the_bench_drives_independent_traffic_and_without_a_gpu_says_why_nothing_ran(triton_cache, tmp_path):
    """bench/sglang_traffic.py never imports the provider; here (no GPU) it installs the bundle for real, its
    measuring process says it has no CUDA device, and the JSON keeps the run and the coverage still to be seen."""
    import ast
    import json
    import os

    from prewarm.shipping.pack import pack

    script = REPO / "bench" / "sglang_traffic.py"
    imports = {n.module for n in ast.walk(ast.parse(script.read_text())) if isinstance(n, ast.ImportFrom)}
    assert "traffic.sglang_cuda" in imports and not any("sglang.cuda" in (m or "") for m in imports)
    pack(triton_cache, tmp_path / "bundle")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES")}
    done = subprocess.run([sys.executable, str(script), "--bundle", str(tmp_path / "bundle"), "--seeds", "3",
                           "--sglang-path", str(REPO / "build" / "sglang"), "--out", str(tmp_path / "st.json"),
                           "--work-dir", str(tmp_path / "work")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    doc = json.loads((tmp_path / "st.json").read_text())
    assert [r["seed"] for r in doc["runs"]] == [3] and "no CUDA device visible" in doc["runs"][0]["error"]
    assert doc["runs"][0]["install_s"] > 0 and doc["coverage"]["batch_sizes_missed"] == list(range(1, 129))
