"""sglang 0.5.23's CUDA model step around the KDA and MoE layers, planned by ``prewarm.providers.sglang.cuda`` for the
shipped H200 manifest, checked against independent step-level traffic (``tests/traffic/sglang_cuda_step.py``:
written from sglang's scheduler, FA3 backend, DeepSeek MLA code and EAGLE v2 worker with its graph runners, not from
the provider): the scheduler's ``req_to_token`` writes, the MLA layers' KV store, prefix read-back and prefill concat
with FA3's CUDA-graph metadata, the MoE router, the EAGLE worker's draft cache locations, top-1 draft argmax, chain
tree, verify commit and draft extend, the overlap scheduler's gather, the grammar mask on the sampler's and the
verify's logits. Every compile request the traffic makes has its key in the plan (the key Triton computes, the one a
node's runtime looks up), and every sglang JIT module it reaches (the MLA KV store, ``silu_and_mul``, the greedy and
sampled tree verify) is one the plan builds.
"""
from __future__ import annotations

from collections import Counter

import pytest

from prewarm.building.probe import planned_keys
from test_sglang import runtime_compiles
from test_sglang_layer import planned  # noqa: F401  (the module's fixture: the shipped manifest's plan)
from traffic import sglang_cuda_step
from traffic.closure import fresh_seed

CALLS_PER_SEED = 80
# what one seed's steps reach, whatever it draws (a seeded cycle of modes, shapes, prefixes and grammar): the
# scheduler's writes, the EAGLE worker's kernels, the FA3 graph metadata, the MLA KV read-back and MHA concat, the
# grammar mask, the router (the MLA KV store itself is sglang's JIT module on Hopper: no Triton launch)
STEP_KERNELS = {"write_req_to_token_pool_triton", "assign_req_to_token_pool", "assign_draft_cache_locs_contiguous",
                "_draft_topk1_partial_argmax_kernel", "_draft_topk1_finalize_kernel", "_build_chain_tree_kernel",
                "_verify_commit_outputs_kernel", "_draft_extend_inputs_kernel", "_prepare_draft_extend_lengths_kernel",
                "_fused_decode_metadata_kernel", "_draft_extend_metadata_kernel", "get_mla_kv_buffer_kernel",
                "concat_and_cast_mha_k_kernel", "apply_token_bitmask_inplace_kernel",
                "create_trtllm_mha_kv_indices_triton", "_gather_rows_kernel", "_router_triton_kernel"}
STEP_JIT = {"set_mla_kv_buffer", "activation", "speculative_tree", "speculative_sampling"}


def _jit_names(requests) -> set[str]:
    return {j.name for j in requests}


@pytest.mark.parametrize("seed", [5, fresh_seed()], ids=lambda s: f"seed{s}")
def test_step_traffic_requests_nothing_the_plan_lacks(planned, seed):  # noqa: F811
    m, p, keys = planned
    calls = list(sglang_cuda_step.calls(m.spec(), seed, CALLS_PER_SEED, "cuda"))
    sglang_cuda_step.import_kernels()
    compiles, jit = runtime_compiles(m.spec(), calls)
    reached = {c.kernel.split(":")[1] for c in compiles.values()}
    assert STEP_KERNELS <= reached, f"seed {seed}: the traffic reached no {sorted(STEP_KERNELS - reached)}"
    assert {c.options["mode"] for c in calls} == {"extend", "spec"}
    assert {c.options["kind"] for c in calls} <= set(sglang_cuda_step.kinds(m.spec()))  # what the benches count
    missing = [c for key, c in planned_keys(list(compiles.values())).items() if key not in keys]
    by_kernel = Counter(c.kernel.split(":")[1] for c in missing)
    assert not missing, (f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): {len(missing)} of {len(compiles)} "
                         f"compile requests not planned, by kernel: {dict(by_kernel.most_common())}; e.g.\n"
                         + "\n".join(sorted({c.label for c in missing})[:12]))
    reached_jit = {j for j in jit if j.library == "sglang"}
    assert {n for n in STEP_JIT if any(j.name.startswith(f"sgl_kernel_jit_{n}") for j in reached_jit)} == STEP_JIT
    unplanned = sorted(_jit_names(reached_jit) - _jit_names(j for j in p.jit if j.library == "sglang"))
    assert not unplanned, f"seed {seed}: sglang JIT modules the steps reach, not planned: {unplanned}"
