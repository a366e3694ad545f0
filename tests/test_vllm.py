"""vLLM 0.34.0's own KDA kernels (``prewarm.providers.vllm_kda``) planned for the H200 from the wheel's real kernel
files (``build/vllm``, assembled by ``.ci/setup``), checked against independent traffic
(``prewarm.providers.vllm_traffic``: written from vLLM's Kimi-Linear layer, not from the provider) run through vLLM's
own wrappers on fake tensors, compared by the key Triton computes for each request (``prewarm.probe.planned_keys``).
No build: keys need none. No H200 recording of vLLM exists yet (README, Known limits).
"""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from closure_traffic import fresh_seed
from prewarm import tritoncompat
from prewarm.backends import get_target
from prewarm.manifest import load
from prewarm.plan import Compile, plan_for
from prewarm.probe import planned_keys
from prewarm.providers import vllm_kda, vllm_traffic
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
    from prewarm.explain import explain

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
