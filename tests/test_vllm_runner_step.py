"""vLLM 0.34.0's V2 model-runner step for Kimi-Linear with MTP (the shipped H200 vLLM manifest), checked against an
independent step generator (``tests/traffic/vllm_runner_step.py``: written only from vLLM's model runner, request
state, block tables, sampler, rejection sampler, MTP speculator, mamba hybrid model state and KV-block zeroer; never
from ``prewarm.providers.vllm`` nor the other model-level traffic) on fake tensors under Triton's real key
computation (``test_vllm.runtime_compiles``): every compile request a step makes has its key in the plan, and the
steps reach every kernel the reading of those sources says they reach.

Excluded from the generator: the requests' per-request sampling options (logit bias, bad words, logprobs and prompt
logprobs, Triton top-k / top-p, the structured-output bitmask, the option tables' staged writes), planned by the
component ``sampler_options`` and checked by ``tests/test_vllm_sampling_options.py``'s own independent traffic; and,
each listed by ``prewarm plan manifests/kimi-linear-h200-vllm.toml`` under "not planned" with its reason (the
generator's docstring names each): the thinking budget and ``--use-fp64-gumbel``, ``VLLM_COMPUTE_NANS_IN_LOGITS``
(sampler), the rejection sampler's other methods (rejection_sampler), the probabilistic-draft and
adaptive-verification kernels (speculator), the DS conv layout and ReplaySSM / RecoverSSM (mamba).
"""
from __future__ import annotations

from collections import Counter

import pytest

from prewarm.building.probe import planned_keys
from test_vllm import runtime_compiles
from test_vllm_model import planned  # noqa: F401  (the module's fixture: the shipped manifest's plan, built once)
from traffic import vllm_runner_step
from traffic.closure import fresh_seed

STEPS_PER_SEED = 36
# what one seed's steps reach, whatever they draw (a seeded cycle of prefill / decode / mixed steps; sampling
# options drawn per request, each seen within a few steps): the request state's and block tables' staged writes,
# the input preparation, the block-table gather and slot mappings, the mamba align pre-copy / aligned indices /
# post-copy and accepted counts, the sampler (penalties with their bincount, temperature, min-p, Gumbel), the
# rejection sampler, the post-step update, the MTP drafter's inputs and greedy argmax
STEP_KERNELS = {
    "_apply_write_kernel", "_bincount_kernel",
    "_expand_idx_mapping_kernel", "_prepare_prefill_inputs_kernel", "_prepare_pos_seq_lens_kernel",
    "_combine_sampled_and_draft_tokens_kernel", "_gather_block_tables_kernel", "_compute_slot_mappings_kernel",
    "preprocess_mamba_align_fused_kernel", "precopy_mamba_align_fused_kernel",
    "get_aligned_state_indices_multi_group_kernel", "postprocess_mamba_fused_kernel",
    "_scatter_num_accepted_kernel",
    "_penalties_kernel", "_temperature_kernel", "_min_p_kernel", "_gumbel_sample_kernel", "_gumbel_combine_kernel",
    "_get_num_sampled_and_rejected_kernel",
    "_gather_draft_sampled_kernel", "_compute_local_logits_stats_kernel", "_rejection_kernel", "_resample_kernel",
    "_insert_resampled_kernel",
    "_post_update_kernel",
    "_prepare_decode_inputs_kernel", "_update_draft_inputs_kernel", "_argmax_partial", "_argmax_finish",
}
# GPUModelRunner.update_requests zeroes each newly allocated attention block (KVBlockZeroer, vllm/v1/worker/utils.py:
# a hybrid model's KVCacheConfig.needs_kv_cache_zeroing is on; its warmup zeroes block 0 at start-up). Found missing
# from the plan by this traffic (vLLM 0.34.0), planned since by the runner component.
STEP_KERNELS.add("_zero_kv_blocks_kernel")


@pytest.mark.parametrize("seed", [11, fresh_seed()], ids=lambda s: f"seed{s}")
def test_runner_step_traffic_requests_nothing_the_plan_lacks(planned, seed):  # noqa: F811
    m, _, keys = planned
    calls = list(vllm_runner_step.calls(m.spec(), seed, STEPS_PER_SEED, "cuda"))
    assert {c.options["kind"] for c in calls} == set(vllm_runner_step.kinds(m.spec()))
    assert any(c.options["graph"] for c in calls) and any(not c.options["graph"] for c in calls)
    assert {(c.options["sampler"], c.options["logits"]) for c in calls} == {
        (s, dtype) for s in ("sampler", "rejection") for dtype in ("bfloat16", "float32")}
    compiles = runtime_compiles(calls)
    reached = {c.kernel.split(":")[1] for c in compiles.values()}
    assert reached == STEP_KERNELS, (f"seed {seed}: not reached {sorted(STEP_KERNELS - reached)}, "
                                     f"reached beyond the reading {sorted(reached - STEP_KERNELS)}")
    missing = [c for key, c in planned_keys(list(compiles.values())).items() if key not in keys]
    by_kernel = Counter(c.kernel.split(":")[1] for c in missing)
    assert not missing, (f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): {len(missing)} of {len(compiles)} "
                         f"compile requests not planned, by kernel: {dict(by_kernel.most_common())}; e.g.\n"
                         + "\n".join(sorted({c.label for c in missing})[:12]))
