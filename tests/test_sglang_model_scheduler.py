"""The sglang CUDA plan's scheduler req_to_token writes (``prewarm.providers.sglang.model_scheduler``, component
``runner``) and sampler kernels (``model_sampler``, component ``sampler``), as `prewarm plan` shows them for a small
Kimi-Linear-shaped deployment: what a user reads off the plan (the kernels, their constexprs per launch line, what is
not planned and why). Whether the plan covers what sglang launches is checked apart, by independent traffic.
"""
from __future__ import annotations

import pytest

from prewarm.building.backends import get_target
from prewarm.building.tritoncompat import parse_specialization
from prewarm.planning.manifest import load
from prewarm.planning.plan import coverage, plan_for

CONTEXT = 1048576  # Kimi-Linear's config.json model_max_length
WRITE = "sglang.kernels.ops.memory.common:write_req_to_token_pool_triton"
RESERVE = "sglang.srt.mem_cache.allocation:assign_req_to_token_pool"
MASK = "sglang.kernels.ops.grammar.bitmask_ops:apply_token_bitmask_inplace_kernel"
MANIFEST = """name = "scheduler-sampler"
[target]
backend = "cuda"
arch = "sm_90"
device = "H200"
[spec.model]
kda_heads = 32
head_k_dim = 128
head_v_dim = 128
layers = 1
[spec.parallel]
tensor_parallel = 1
attention_dp = 1
[spec.dtypes]
activation = "bfloat16"
gate = "bfloat16"
index = ["int32"]
[spec.serving]
prefill = true
max_running_requests = 24
max_prefill_tokens = 256
{serving}
[spec.sglang]
paths = ["extend"]
track_state = false
mamba_pool_slots = 25
sampling_backend = "pytorch"
[spec.sglang.model]
hidden_size = 2304
num_experts = 256
experts_per_token = 8
moe_intermediate_size = 1024
vocab_size = 163840
{model}
[[kernels]]
provider = "prewarm.providers.sglang.cuda"
"""


def _plan(tmp_path, serving: str = "", model: str = ""):
    path = tmp_path / "m.toml"
    path.write_text(MANIFEST.format(serving=serving, model=model))
    p = plan_for(load(path), get_target("cuda", "sm_90", "offline", "H200"))
    ((entry,),) = [coverage(p)]
    return p, {c["component"]: c for c in entry["components"]}


def _requests(p, kernel):
    return [parse_specialization(c.specialization) for c in p.compiles if c.kernel == kernel]


@pytest.fixture(scope="module")
def speculative(tmp_path_factory):
    """Launch lines with --speculative-num-draft-tokens 2 and 4 merged, --max-running-requests 24."""
    return _plan(tmp_path_factory.mktemp("spec"), "draft_widths = [2, 4]", f"context_length = {CONTEXT}")


def test_each_launch_lines_req_to_token_row_length_is_planned(speculative):
    """The table's row length (context + 4 + draft tokens) is a constexpr of both writes: one per launch line; the
    decode reservation also at every next_power_of_2 of a batch up to 24; the allocator's slots at both alignments."""
    p, _ = speculative
    writes = _requests(p, WRITE)
    assert {a.args["req_to_token_ptr_stride"].value for a in writes} == {CONTEXT + 6, CONTEXT + 8}
    assert {a.args["out_cache_loc"].describe() for a in writes} == {"*i64 16-byte aligned",
                                                                    "*i64 not 16-byte aligned"}
    assert {a.args["prefix_tensors"].type for a in writes} == {"*u64"}
    reserves = _requests(p, RESERVE)
    assert {(a.args["pool_len"].value, a.args["bs_upper"].value) for a in reserves} == {
        (CONTEXT + d, b) for d in (6, 8) for b in (1, 2, 4, 8, 16, 32)}
    assert {a.args["start_offset"].type for a in reserves} == {"*i32"}
    assert len(reserves) == 2 * 6 * 2


def test_the_grammar_mask_is_planned_per_row_class_at_the_h200s_sm_count(speculative):
    """Structured output's vocab mask: the H200's 132 SMs compiled in, one request per row-count class (1, 16k,
    other) the batches and verify rows reach; the sampler's Triton-free paths are named with why."""
    p, components = speculative
    masks = _requests(p, MASK)
    assert {a.args["NUM_SMS"].value for a in masks} == {132}
    assert len(masks) == 3 and len({a.args["num_rows"].describe() for a in masks}) == 3
    sampler = components["sampler"]
    assert sampler["kernels"] == [MASK] and not sampler["unreached"]
    assert any("murmur_hash32" in item["what"] and "deterministic" in item["why"] for item in sampler["not_planned"])
    runner = components["runner"]
    assert {WRITE, RESERVE} <= set(runner["kernels"]) and not runner["unreached"]


def test_without_speculation_only_the_prefill_write_is_planned(tmp_path):
    """A launch line without speculative decoding: rows of context + 4; decode writes the table with torch."""
    p, components = _plan(tmp_path, "", f"context_length = {CONTEXT}")
    assert {a.args["req_to_token_ptr_stride"].value for a in _requests(p, WRITE)} == {CONTEXT + 4}
    assert not _requests(p, RESERVE)
    assert not components["runner"]["unreached"]


def test_without_a_context_length_the_writes_are_named_not_planned(tmp_path):
    p, components = _plan(tmp_path, "draft_widths = [3]")
    assert not _requests(p, WRITE) and not _requests(p, RESERVE)
    runner = components["runner"]
    assert not runner["unreached"]
    assert any("context_length" in item["why"] for item in runner["not_planned"])
