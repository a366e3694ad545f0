"""vLLM 0.34.0's Kimi-Linear KDA layer planned whole: the shipped manifest's plan (``prewarm.providers.vllm.kda``,
driving ``KimiGatedDeltaNetAttention.forward`` through ``prewarm.providers.vllm.layer``) against independent
layer-level traffic (``tests/traffic/vllm_layer.py``: written from vLLM's builder and model runner, not from the
provider), by the key Triton computes for each compile request on fake tensors. Every kernel the layer launches is
in the plan: the KDA core, the causal conv (prefill and update), the gathered and scattered states, the gated
RMSNorm (``o_norm``), the spec-verify recurrent kernel."""
from __future__ import annotations

from pathlib import Path

import pytest

from traffic.closure import fresh_seed
from prewarm.building.backends import get_target
from prewarm.planning.manifest import load
from prewarm.planning.plan import plan_for
from prewarm.building.probe import planned_keys
from test_vllm import not_planned, runtime_compiles
from traffic import vllm_layer as traffic

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "kimi-linear-h200-vllm.toml"
STEPS_PER_SEED = 60
LAYER_KERNELS = {"_causal_conv1d_fwd_kernel", "_causal_conv1d_update_kernel", "_gather_initial_states_kernel",
                 "_scatter_states_kernel", "layer_norm_gated_fwd_kernel", "fused_recurrent_kda_fwd_kernel",
                 "fused_recurrent_kda_packed_decode_kernel", "chunk_gla_fwd_kernel_o"}


@pytest.fixture(scope="module")
def planned():
    m = load(MANIFEST)
    p = plan_for(m, get_target("cuda", "sm_90", "offline", "H200"))
    return m, p, planned_keys(p.compiles)


def test_the_plan_holds_every_kernel_the_layer_launches(planned):
    _, p, _ = planned
    assert LAYER_KERNELS <= {c.kernel.split(":")[1] for c in p.compiles}


@pytest.mark.parametrize("seed", [7, fresh_seed()], ids=lambda s: f"seed{s}")
def test_layer_traffic_requests_nothing_the_plan_lacks(planned, seed):
    m, _, _ = planned
    calls = list(traffic.calls(m.spec(), seed, STEPS_PER_SEED, "cuda"))
    compiles = runtime_compiles(calls)
    missing = not_planned(list(compiles.values()), planned)
    assert not missing, f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): not planned:\n{missing}"
    kernels = {c.kernel.split(":")[1] for c in compiles.values()}
    assert LAYER_KERNELS - {"chunk_gla_fwd_kernel_o"} <= kernels, LAYER_KERNELS - kernels


def test_the_layer_api_table_accounts_for_every_parameter():
    """The layer's forward and each op it calls, read from the installed vLLM: a parameter vLLM adds fails here
    until the provider says how it plans it."""
    import importlib
    import inspect

    from prewarm.providers.vllm.layer import LAYER_API

    for (module, qualname), table in LAYER_API.items():
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        params = list(inspect.signature(obj).parameters)
        assert set(params) == set(table), (qualname, sorted(set(params) ^ set(table)))


def test_the_stand_in_metadata_record_and_slot_ids_are_the_wheels():
    """build/vllm's GDN metadata classes are the wheel's source (cut by assemble.py), its slot ids the wheel's."""
    import ast
    import zipfile

    import vllm.v1.attention.backends.gdn_attn as gdn_attn
    import vllm.v1.attention.backends.utils as backend_utils

    (wheel,) = (REPO / "build" / "wheels").glob("vllm-0.34.0-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read("vllm/v1/attention/backends/gdn_attn.py").decode()
        utils = zf.read("vllm/v1/attention/backends/utils.py").decode()
    wheel_classes = {n.name: ast.get_source_segment(source, n) for n in ast.parse(source).body
                     if isinstance(n, ast.ClassDef)}
    ours = Path(gdn_attn.__file__).read_text()
    assert wheel_classes["GDNAttentionMetadata"] in ours and wheel_classes["GDNFlashInferCheckpointPlan"] in ours
    constants = {t.id: ast.literal_eval(n.value) for n in ast.parse(utils).body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and t.id in ("PAD_SLOT_ID", "NULL_BLOCK_ID")}
    assert constants == {"PAD_SLOT_ID": backend_utils.PAD_SLOT_ID, "NULL_BLOCK_ID": backend_utils.NULL_BLOCK_ID}


@pytest.mark.parametrize("custom_ops,norm", [([["all"]], True), ([["none"]], False),
                                             ([["none", "+fused_rms_norm_gated"]], True),
                                             ([["all", "-fused_rms_norm_gated"]], False),
                                             ([["none"], ["all"]], True)])
def test_custom_ops_decide_whether_the_norm_kernel_is_planned(planned, custom_ops, norm):
    """o_norm is a CustomOp: vLLM's own rule on the compilation config's custom_ops picks its Triton forward_cuda
    or its torch forward_native; the plan follows (and prewarm plan says which)."""
    from prewarm.providers.vllm import kda as vllm_kda

    spec = {"backend": "cuda", "model": {"kda_heads": 32, "head_k_dim": 128, "head_v_dim": 128},
            "serving": {"decode_batch_buckets": [2], "prefill": False},
            "dtypes": {"activation": "bfloat16", "gate": "bfloat16", "beta": "bfloat16", "gate_params": "float32",
                       "index": "int32"},
            "vllm": {"paths": ["decode"], "custom_ops": custom_ops}}
    names = {vllm_kda._kernel_name(launch) for launch in vllm_kda.launches(spec)}
    assert ("layer_norm_gated_fwd_kernel" in names) is norm and "_causal_conv1d_update_kernel" in names
    (row,) = [r for r in vllm_kda.options(spec) if r["key"] == "spec.vllm.custom_ops"]
    assert row["given"] and ("layer_norm_gated_fwd_kernel: planned" in row["derived"]) is norm


def test_the_mamba_page_is_padded_to_the_attention_page_as_vllm_pads_it():
    """Kimi-Linear on one H200 rank, num_speculative_tokens 3: the conv state (3 + 3) x 12288 bf16 and the 32 x 128
    x 128 fp32 state make a 2244608 B page; FlashMLA's 576 x 2 B per token at 128-token alignment needs 2048 tokens
    (16 x 128 x 1152 B >= the page): the page is padded to 2359296 B, the recurrent slot stride 589824 elements."""
    from prewarm.providers.vllm.layer import padded_page, page_bytes

    page = page_bytes(32, 128, 4, 3, "bfloat16")
    assert page == (4 - 1 + 3) * 3 * 32 * 128 * 2 + 32 * 128 * 128 * 4 == 2244608
    assert padded_page(page, 1152, None) == (2359296, 2048)
    assert padded_page(page, 1152, 4096) == (4096 * 1152, 4096)  # a larger --block-size is kept
    assert padded_page(page_bytes(8, 128, 4, 0, "bfloat16"), 1152, None) == (128 * 1152 * 4, 512)  # TP4, no spec


@pytest.mark.parametrize("arch,compilation,eager,level,env,expected", [
    (["KimiLinearForCausalLM"], {}, False, None, {}, ["all"]),  # breakable CUDA graphs by default: mode NONE
    (["KimiLinearForCausalLM"], {}, False, None, {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}, ["none"]),
    (["OtherForCausalLM"], {}, False, None, {}, ["none"]),  # Inductor compiles: custom ops off
    (["OtherForCausalLM"], {}, True, None, {}, ["all"]),  # --enforce-eager
    (["OtherForCausalLM"], {}, False, "0", {}, ["all"]),  # -O0
    (["OtherForCausalLM"], {"custom_ops": ["+fused_rms_norm_gated"]}, False, None, {},
     ["+fused_rms_norm_gated", "none"]),
    (["KimiLinearForCausalLM"], {"custom_ops": ["none"]}, False, None, {}, ["none"]),
])
def test_custom_ops_are_completed_as_vllm_completes_them(arch, compilation, eager, level, env, expected):
    from prewarm.providers.vllm.layer import custom_ops_setting

    assert custom_ops_setting(arch, compilation, eager, level, env)[0] == expected
