"""vLLM 0.34.0's V2 sampler and MTP rejection sampler under per-request SamplingParams options (the shipped H200
vLLM manifest), checked against independent traffic (``tests/traffic/vllm_sampling_options.py``: written only from
vLLM's sampler, sampling states, logits processors, logprob, prompt-logprob, top-k / top-p, structured-output and
rejection-sampler sources; never from ``prewarm.providers.vllm`` nor the other vLLM traffic) on fake tensors under
Triton's real key computation (``test_vllm.runtime_compiles``): every compile request its steps make has its key in
the plan, and the steps reach exactly the kernels the reading of those sources says these options reach.
"""
from __future__ import annotations

from collections import Counter

import pytest

from prewarm.building.probe import planned_keys
from prewarm.node.explain import explain
from test_vllm import runtime_compiles
from test_vllm_model import planned  # noqa: F401  (the module's fixture: the shipped manifest's plan, built once)
from traffic import vllm_sampling_options
from traffic.closure import fresh_seed

# what one seed's steps reach (options drawn per request, every axis within a few steps): the option tables' staged
# writes, the grammar bitmask, logit bias / allowed ids / min tokens, bad words, temperature, min-p, Triton top-k /
# top-p (the monolithic kernel and the split top-p pipeline of small batches), Gumbel sampling, logprobs (token
# logprobs, custom logprob ids, ranks), prompt logprobs (their token ids; prompt_logprob_token_ids' rows, sliced per
# chunk: unaligned views), and under MTP the draft gather, the rejection sampler's kernels and the logprobs'
# flattening. Thinking budget is not reached: its state is enabled only with a reasoning parser's token ids
# (--reasoning-parser), which the manifest's launch line does not pass.
OPTION_KERNELS = {
    "_apply_write_kernel", "_apply_grammar_bitmask_kernel", "_bias_kernel", "_bad_words_kernel",
    "_temperature_kernel", "_min_p_kernel",
    "_topk_topp_kernel", "_topp_sb_stats_kernel", "_topp_sb_step_kernel", "_topp_sb_mask_kernel",
    "_gumbel_sample_kernel", "_gumbel_combine_kernel",
    "_topk_log_softmax_kernel", "_fill_logprob_token_ids_kernel", "_ranks_kernel",
    "_prompt_logprobs_token_ids_kernel",
    "_gather_draft_sampled_kernel", "_compute_local_logits_stats_kernel", "_rejection_kernel", "_resample_kernel",
    "_insert_resampled_kernel", "_flatten_sampled_kernel",
}


@pytest.mark.parametrize("seed", [5, fresh_seed()], ids=lambda s: f"seed{s}")
def test_sampling_option_traffic_requests_nothing_the_plan_lacks(planned, seed):  # noqa: F811
    m, p, keys = planned
    steps = vllm_sampling_options.step_cycle(m.spec())  # every step shape once
    calls = list(vllm_sampling_options.calls(m.spec(), seed, steps, "cuda"))
    assert {c.options["kind"] for c in calls} == set(vllm_sampling_options.kinds(m.spec()))
    assert {c.options["logits"] for c in calls} == {"bfloat16", "float32"}  # the model's, their processed copy
    assert {c.options["fused"] for c in calls} == {True, False}  # VLLM_USE_FLASHINFER_SAMPLER on / off
    compiles = runtime_compiles(calls)
    reached = {c.kernel.split(":")[1] for c in compiles.values()}
    missing = [c for key, c in planned_keys(list(compiles.values())).items() if key not in keys]
    by_kernel = Counter(c.kernel.split(":")[1] for c in missing)
    first = {}  # kernel -> its first miss, with what tells it from the nearest planned compile
    for c in missing:
        first.setdefault(c.kernel, c)
    assert not missing, (f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): {len(missing)} of {len(compiles)} "
                         f"compile requests not planned, by kernel: {dict(by_kernel.most_common())}; e.g.\n"
                         + "\n".join(f"{c.label}\n  {explain(c.specialization, p.compiles, kernel=kernel)}"
                                     for kernel, c in first.items()))
    assert reached == OPTION_KERNELS, (f"seed {seed}: not reached {sorted(OPTION_KERNELS - reached)}, "
                                       f"reached beyond the reading {sorted(reached - OPTION_KERNELS)}")


def test_a_raised_max_logprobs_is_planned_and_the_traffic_asking_it_finds_every_key(planned):  # noqa: F811
    """A launch line with ``--max-logprobs 24`` (``[spec.vllm] max_logprobs``): requests may ask 21..24 logprobs,
    prompt logprobs and prompt logprob token ids. The traffic drawing up to that cap asks for compiles the default
    plan (20) lacks, and the raised plan holds every one."""
    import dataclasses

    from prewarm.building.backends import get_target
    from prewarm.planning.plan import plan_for

    m, _, default_keys = planned
    table = {**m.spec_table, "vllm": {**m.spec_table["vllm"], "max_logprobs": 24}}
    raised = dataclasses.replace(m, spec_table=table)
    keys = planned_keys(plan_for(raised, get_target("cuda", "sm_90", "offline", "H200")).compiles)
    spec = raised.spec()
    calls = list(vllm_sampling_options.calls(spec, 11, vllm_sampling_options.step_cycle(spec), "cuda"))
    wanted = planned_keys(list(runtime_compiles(calls).values()))
    beyond = [c.label for key, c in wanted.items() if key not in default_keys]
    assert beyond, "the traffic asked nothing above the default cap: it does not read the deployment's max_logprobs"
    missing = [c.label for key, c in wanted.items() if key not in keys]
    assert not missing, f"{len(missing)} compile requests not in the max_logprobs = 24 plan, e.g. {missing[:3]}"
