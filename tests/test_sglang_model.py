"""sglang 0.5.23's CUDA model around the KDA layer (``prewarm.providers.sglang.model``), planned by
``prewarm.providers.sglang.cuda`` for the shipped H200 manifest: Kimi-Linear's bf16 MoE through sglang's Triton MoE
runner, with the configs sglang's own lookup picks for an H200 at every token count, checked against independent
model-level traffic (``tests/traffic/sglang_cuda_model.py``: written from sglang's model runner, graph runners and
MoE runner, not from the provider) by the key Triton computes for each compile request, with the logits processor's
cast into the CUDA graph runners' buffer; and the coverage hook's components against the plan.
"""
from __future__ import annotations

from collections import Counter

import pytest

from prewarm.building import tritoncompat
from prewarm.building.probe import planned_keys
from prewarm.planning.plan import coverage
from test_sglang import runtime_compiles
from test_sglang_layer import planned  # noqa: F401  (the module's fixture: the shipped manifest's plan)
from traffic import sglang_cuda_model
from traffic.closure import fresh_seed

CALLS_PER_SEED = 150  # about 2 s per 60 calls on fake tensors; the plan (the fixture) dominates the module
MOE_KERNELS = {"_router_triton_kernel", "fused_moe_kernel", "_moe_sum_reduce_kernel", "_moe_align_small_numel_kernel"}
LOGITS_KERNELS = {"softcap_inplace_logits_kernel"}
# issue 59's done-when list for this manifest, per component: the "module:kernel" names its Triton kernels must plan
# (the MLA KV store on Hopper is sglang's JIT set_mla_kv_buffer: a JIT request, checked by name)
DONE_WHEN = {
    "moe": {"sglang.kernels.ops.moe.fused_moe_triton_kernels:fused_moe_kernel",
            "sglang.kernels.ops.moe.fused_moe_triton_kernels:_moe_sum_reduce_kernel",
            "sglang.kernels.ops.moe.moe_align_small_numel:_moe_align_small_numel_kernel",
            "sglang.kernels.ops.moe.moe_fused_gate:_router_triton_kernel"},
    "logits": {"sglang.kernels.ops.activation.softcap:softcap_inplace_logits_kernel"},
    "mla": {"sglang.kernels.ops.attention.metadata:_fused_decode_metadata_kernel",
            "sglang.kernels.ops.kvcache.mla_buffer:get_mla_kv_buffer_kernel",
            "sglang.kernels.ops.attention.mla_qk_prep:concat_and_cast_mha_k_kernel"},
    "runner": {"sglang.kernels.ops.memory.common:write_req_to_token_pool_triton",
               "sglang.srt.mem_cache.allocation:assign_req_to_token_pool"},
    "spec_worker": {"sglang.kernels.ops.speculative.cache_locs:assign_draft_cache_locs_contiguous",
                    "sglang.kernels.ops.speculative.topk1:_draft_topk1_partial_argmax_kernel",
                    "sglang.kernels.ops.speculative.eagle:_build_chain_tree_kernel",
                    "sglang.kernels.ops.speculative.eagle:_draft_extend_inputs_kernel",
                    "sglang.kernels.ops.speculative.gather_spec_extras:_gather_rows_kernel"},
}
KV_STORE_JIT = "set_mla_kv_buffer"


def _by_kernel(p) -> dict[str, list]:
    out: dict[str, list] = {}
    for c in p.compiles:
        out.setdefault(c.kernel.split(":")[1], []).append(tritoncompat.parse_specialization(c.specialization))
    return out


def test_the_plan_holds_the_moe_with_sglangs_default_configs_at_every_token_range(planned):  # noqa: F811
    """No tuned E=256,N=1024 config ships for the H200: sglang's defaults apply, BLOCK_SIZE_M 16 up to 256 tokens
    (M <= E) and 64 above, each with GDC_EARLY on and off where the deployment reaches both (the gate/up GEMM's
    tokens <= 512, prefill chunks reach 32768); the Triton sum carries Kimi-Linear's routed scaling factor."""
    _, p, _ = planned
    by_kernel = _by_kernel(p)
    assert MOE_KERNELS <= set(by_kernel)
    gemms = {(a.args["BLOCK_SIZE_M"].value, a.args["BLOCK_SIZE_N"].value, a.args["BLOCK_SIZE_K"].value,
              a.args["GDC_EARLY"].value) for a in by_kernel["fused_moe_kernel"]}
    assert {(16, 32, 64, True), (64, 64, 32, True), (64, 64, 32, False)} <= gemms, gemms
    assert {a.args["routed_scaling_factor"].value for a in by_kernel["_moe_sum_reduce_kernel"]} == {2.446}
    assert {a.args["MUL_ROUTED_WEIGHT"].value for a in by_kernel["fused_moe_kernel"]} == {False, True}


@pytest.mark.parametrize("seed", [7, fresh_seed()], ids=lambda s: f"seed{s}")
def test_model_traffic_requests_nothing_the_plan_lacks(planned, seed):  # noqa: F811
    m, _, keys = planned
    calls = list(sglang_cuda_model.calls(m.spec(), seed, CALLS_PER_SEED, "cuda"))
    compiles, _ = runtime_compiles(m.spec(), calls)
    assert MOE_KERNELS | LOGITS_KERNELS <= {c.kernel.split(":")[1] for c in compiles.values()}
    assert {c.options["kind"] for c in calls} == {"prefill", "decode", "graph_decode", "target_verify",
                                                  "graph_verify"}
    missing = [c for key, c in planned_keys(list(compiles.values())).items() if key not in keys]
    by_kernel = Counter(c.kernel.split(":")[1] for c in missing)
    assert not missing, (f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): {len(missing)} of {len(compiles)} "
                         f"compile requests not planned, by kernel: {dict(by_kernel.most_common())}; e.g.\n"
                         + "\n".join(sorted({c.label for c in missing})[:12]))


def test_the_coverage_hook_names_each_component_and_the_plan_counts_it(planned):  # noqa: F811
    """``prewarm plan`` reports the provider per model component: each launch's label starts with its component,
    every kernel a component says it plans was launched, and what the model reaches unplanned is named with why."""
    _, p, _ = planned
    (entry,) = coverage(p)
    components = {c["component"]: c for c in entry["components"]}
    assert {"kda", "moe", "runner", "allocator", "spec_worker", "mla", "sampler", "logits"} <= set(components)
    assert all(not c["unreached"] for c in components.values()), {n: c["unreached"] for n, c in components.items()}
    assert {k.split(":")[1] for k in components["moe"]["kernels"]} == MOE_KERNELS
    assert components["kda"]["compiles"] > 500 and components["moe"]["compiles"] > 0
    assert sum(c["requests"] for c in components.values()) == len(p.requests)
    assert {k.split(":")[1] for k in components["logits"]["kernels"]} == LOGITS_KERNELS
    for name, kernels in DONE_WHEN.items():  # issue 59: what `prewarm plan` of this manifest lists
        assert kernels <= set(components[name]["kernels"]) and components[name]["compiles"] > 0, \
            (name, sorted(kernels - set(components[name]["kernels"])))
    assert any(KV_STORE_JIT in j.name for j in p.jit if j.library == "sglang"), [j.name for j in p.jit]
    assert "the router (biased_grouped_topk_gpu)" not in {item["what"] for item in components["moe"]["not_planned"]}
    assert all(item["why"] for c in components.values() for item in c["not_planned"])
