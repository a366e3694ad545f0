"""sglang 0.5.23's Ascend KDA backend on triton-ascend 3.2.0 (no NPU, no torch_npu, the CANN ops stood in): the A3
profile answers torch.npu's queries as torch_npu would; independent traffic (``traffic.sglang_ascend``,
in tests/traffic: the backend made by its own constructors, pools and metadata from sglang's sources, the report-era
prefill from the report author's fork) drives ``AscendKDAAttnBackend`` through both prefill layouts, decode and DSPARK
verify with the state updates after it, and every launch is checked against the shipped manifest's plan: a kernel
this triton-ascend keys is compiled there with the launch's very specialization (Triton's own JIT binding computes
it, an autotuned kernel in the config the guard gives it), a kernel it cannot key is in the will-fail verdict, and
the verdict names nothing else. The shipped manifest's own lowering is `.ci/run`'s `prewarm lower`.
"""
from __future__ import annotations

import collections

import pytest
import sglang_closure
from sglang_closure import MANIFEST
from traffic.closure import fresh_seed

from prewarm.building import tritoncompat
from prewarm.planning.manifest import load

CALLS_PER_SEED = 90
RECURRENT = ("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent:"
             "fused_sigmoid_gating_delta_rule_update_kernel")
O_NORM = "sglang.kernels.ops.attention.fla.fused_norm_gate:layer_norm_gated_fwd_kernel"
CUMSUM = "sglang.kernels.ops.attention.fla.cumsum:chunk_local_cumsum_vector_kernel"
SGLANG_L2NORM = "sglang.kernels.ops.attention.fla.l2norm:l2norm_fwd_kernel"


@pytest.fixture(scope="module")
def planned(sglang_k3):
    """The shipped manifest's plan under the A3 profile (conftest: planned once per session, A3 active here)."""
    return sglang_k3


@pytest.fixture(scope="module")
def verdict(sglang_k3_verdict) -> dict[str, dict[str, str]]:
    return sglang_k3_verdict


def test_the_a3_profile_answers_torch_npu_as_torch_npu_would(planned):
    import torch
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel
    from sglang.srt.utils import is_npu

    assert torch.npu.is_available() and torch.npu.device_count() == 1
    assert torch.npu.get_device_name(0) == "Ascend910_9391" and torch.device("npu").type == "npu"
    with torch.npu.device(0):
        pass
    assert is_npu() and not TritonKDAKernel.supports_packed_decode  # sglang's NPU decode: the recurrent kernel


@pytest.mark.parametrize("seed", [0, fresh_seed()], ids=lambda s: f"seed{s}")
def test_independent_traffic_makes_only_planned_requests(planned, verdict, seed):
    """Every launch of the traffic is planned: a keyable kernel's specialization among the plan's compiles (0
    missing), an unkeyable one's among the will-fail verdict's requests; the verdict holds exactly the kernels the
    traffic could not key; both prefill layouts, decode and verify (each width, dense and ragged) ran."""
    from prewarm.planning.pins import pin_chooser
    from prewarm.providers import capture
    from prewarm.providers.sglang import common
    from traffic import sglang_ascend as ascend_traffic
    from prewarm.providers.sglang.ascend import cann_ops

    m, p = planned
    compiles = sglang_closure.by_kernel(p.compiles)
    choose = pin_chooser(p.pins)  # what the guard gives each Autotuner on the node
    keyable, missed = {}, collections.defaultdict(list)  # (kernel, how it differs) -> the calls
    layouts, verified, decoded = collections.defaultdict(set), set(), 0  # what ran
    ascend_traffic.import_kernels()
    with common.fake_device("npu"), cann_ops():
        for call in ascend_traffic.calls(m.spec(), seed, CALLS_PER_SEED):
            o = call.options
            decoded += o["kind"] == "decode"
            if o["kind"] == "target_verify":
                verified.add((o["draft"], o["ragged"]))
            for launch in capture.launches_of(call.run):
                ref = tritoncompat.kernel_ref(launch.kernel)
                if ref not in keyable:
                    keyable[ref] = sglang_closure.keys(launch.kernel)
                if o["kind"] == "extend":
                    layouts[o["prefill"]].add(ref)
                plan_of = (compiles if keyable[ref] else verdict).get(ref, {})
                for data in sglang_closure.specializations(launch, choose):
                    if data not in plan_of:
                        where = "compiles" if keyable[ref] else "will-fail verdict"
                        nearest, differs = sglang_closure.nearest(launch.kernel, data, plan_of)
                        missed[f"{ref} (not in the plan's {where}): {differs}"].append(f"{call.label}; {nearest}")
    assert not missed, f"seed {seed}: launches not planned:\n" + "\n".join(
        f"{what}: {len(seen)} launches, e.g. {seen[0]}" for what, seen in missed.items())
    assert {ref for ref, keys in keyable.items() if not keys} == {w.kernel for w in p.will_fail} == {RECURRENT, O_NORM}
    # both layouts ran: 0.5.23's (sglang's l2norm around the CANN core) and the report era's Triton decomposition
    assert CUMSUM in layouts["triton"] - layouts["cann"] and SGLANG_L2NORM in layouts["cann"] - layouts["triton"]
    assert verified == {(width, ragged) for width in (4, 8) for ragged in (False, True)} and decoded


def test_triton_ascend_32_cannot_hash_the_o_norm_or_the_decode_kernel(planned):
    """Why those two are will-fail: sglang 0.5.23's o_norm kernel (every mode) and decode kernel name
    tl.extra.cuda (gdc_wait, gdc_launch_dependents) and triton-ascend 3.2.0 has no triton.language.extra.cuda, so
    its JIT cannot hash their source, on a node as here. When this test fails, the installed triton-ascend can."""
    from sglang.kernels.ops.attention.fla.fused_norm_gate import layer_norm_gated_fwd_kernel
    from sglang.kernels.ops.attention.fla.l2norm import l2norm_fwd_kernel
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update_kernel as recurrent,
    )

    assert l2norm_fwd_kernel.cache_key
    for kernel in (recurrent, layer_norm_gated_fwd_kernel):
        with pytest.raises(AttributeError, match="extra.* has no attribute 'cuda'"):
            tritoncompat.jit_function(kernel).cache_key  # noqa: B018


# --- the model step beyond the KDA layers (prewarm.providers.sglang.ascend's components) ---------------------------

DRIVEN = ("kda", "attn_residual", "mlp", "moe", "allocator", "runner", "logits", "spec_worker")


def _constexprs(p, kernel: str) -> list[dict]:
    """Each planned compile of ``kernel``: its constexpr name -> value, and each pointer's dtype under ``*name``."""
    out = []
    for c in p.compiles:
        if c.kernel == kernel:
            args = c.parsed.args
            out.append({**{n: a.value for n, a in args.items() if a.type == "constexpr"},
                        **{f"*{n}": a.type for n, a in args.items() if a.type.startswith("*")}})
    return out


def test_every_component_is_reported_and_plans_what_it_claims(planned):
    """`prewarm plan`'s per-component report for the shipped manifest: every driven component plans kernels and
    each kernel its coverage hook names is reached by a launch of that component; every component listed names
    what it does not plan with a reason; the two will-fail kernels are the KDA component's."""
    from prewarm.planning.plan import coverage

    _, p = planned
    (entry,) = coverage(p)
    components = {c["component"]: c for c in entry["components"]}
    assert list(components)[:len(DRIVEN)] == list(DRIVEN)
    for name in DRIVEN:
        assert components[name]["kernels"] and components[name]["compiles"] and not components[name]["unreached"]
    assert {k for c in components.values() for k in c["will_fail"]} == set(components["kda"]["will_fail"]) == {
        RECURRENT, O_NORM}
    assert all(item["why"] for c in components.values() for item in c["not_planned"])
    assert "sgl_kernel_npu.kimi_k3.attn_residual:_mix_fused_kernel" in components["attn_residual"]["kernels"]
    assert components["moe"]["kernels"] == ["sgl_kernel_npu.activation.situ:_situ_kernel"]
    cast = _constexprs(p, "sglang.kernels.ops.activation.softcap:softcap_inplace_logits_kernel")
    assert {(c["CAST_TO_FP32"], c["APPLY_SOFTCAP"], c["*full_logits_ptr"], c["*output_ptr"]) for c in cast} == {
        (True, False, "*bf16", "*fp32")}  # the logits' fp32 cast into the graph buffer, no softcap (K3 has none)


def test_the_autotuned_situ_is_pinned_and_nothing_benchmarks(planned):
    """The dense MLP's and shared experts' SiTU (``_situ_and_mul_kernel``, 4 autotune configs) is planned in the
    table's pinned config alone, at both widths (528: the dense MLP over TP 64; 6144: the replicated shared
    experts); no autotuned kernel of the plan is left to benchmark on a node."""
    from prewarm.building.autotune import autotuned_kernels

    _, p = planned
    situ = _constexprs(p, "sgl_kernel_npu.activation.situ:_situ_and_mul_kernel")
    assert {(c["HALF_COLS"], c["BLOCK_H"], c["HAS_GROUP_LIST"]) for c in situ} == {(528, 1024, False),
                                                                                  (6144, 1024, False)}
    tuned = autotuned_kernels(p.requests, p.pins)
    assert "sgl_kernel_npu.activation.situ:_situ_and_mul_kernel" in {k.kernel for k in tuned}
    assert all(k.pin is not None for k in tuned if not k.keeps)


def test_the_routed_situ_requantizes_to_int8_for_the_w4a8_checkpoint(planned):
    _, p = planned
    routed = _constexprs(p, "sgl_kernel_npu.activation.situ:_situ_kernel")
    assert {(c["NEED_QUANT"], c["*out_ptr"], c["HALF_COLS"], c["NUM_EXPERTS"], c["GROUP_LIST_TYPE"]) for c in routed} \
        == {(True, "*i8", 3072, 14, 1), (False, "*bf16", 3072, 14, 1)}
    assert {(c["BETA"], c["LINEAR_BETA"]) for c in routed} == {(4.0, 25.0)}


def _aligned(p, kernel: str, pointer: str) -> list[bool]:
    """Each planned compile of ``kernel``: whether its ``pointer`` argument is specialized as 16-byte aligned."""
    return [("tt.divisibility", 16) in c.parsed.args[pointer].attrs for c in p.compiles if c.kernel == kernel]


def test_the_page_allocator_covers_the_deployments_whole_range(planned):
    """Every batch (1..the running-request cap) and token count the NPU allocator's kernel can meet at the manifest's
    page sizes, with sglang's own constexpr formula (``next_power_of_2`` of each), is a planned compile, for both
    callers: a prefill's extend (int64 lengths, both last_loc dtypes ``torch.cat`` can leave; tokens up to the
    prefill budget under 200 pages) and a DSPARK decode step's reservation (the draft input's int32 lengths,
    ``get_last_loc_torch``'s int32 last_loc; at most 2 x draft width + page - 1 tokens per request:
    ``page_aligned_decode_alloc_lens``); each with the free-page list's view 16-byte aligned and not (an odd count
    of pages handed out before)."""
    import triton

    m, p = planned
    kernel = "sgl_kernel_npu.mem_cache.allocator:alloc_extend_kernel"
    planned_keys = {(c["bs_upper"], c["page_size"], c["max_num_extend_tokens"], c["*pre_lens_ptr"], c["*seq_lens_ptr"],
                     c["*last_loc_ptr"], aligned)
                    for c, aligned in zip(_constexprs(p, kernel), _aligned(p, kernel, "free_page_ptr"))}
    serving, pages = m.spec()["serving"], m.spec()["sglang"]["model"]["page_sizes"]
    per_request = 2 * max(serving["draft_widths"])
    for page in (p for p in pages if p > 1):
        for bs in range(1, serving["max_running_requests"] + 1):
            extend = min(serving["max_prefill_tokens"], 199 * page)
            callers = [(extend, "*i64", "*i64"), (extend, "*i64", "*i32"),
                       (min(bs * (per_request + page - 1), 199 * page), "*i32", "*i32")]
            for most, lengths, last_loc in callers:
                for tokens in range(1, most + 1):
                    for aligned in (True, False):
                        key = (triton.next_power_of_2(bs), page, triton.next_power_of_2(tokens), lengths, lengths,
                               last_loc, aligned)
                        assert key in planned_keys, f"bs {bs}, {tokens} tokens: {key} not planned"


def test_dp_attention_gather_and_scatter_are_planned_on_every_dp_rank(planned):
    """``get_dp_local_info``'s offset and count are 0-d views of the int64 token counts and their cumsum at the DP
    rank (rank 0's offset a fresh zero): on the report's 4 DP ranks the (offset, count) pointers are (aligned,
    aligned), (aligned, not), (not, aligned), (aligned, not); each is planned for the gather and the scatter."""
    m, p = planned
    kernel = "sglang.kernels.ops.memory.memcpy_triton:memcpy_triton_kernel"
    dp = m.spec()["parallel"]["attention_dp"]
    pairs = {(start % 2 == 0, rank % 2 == 0) for rank in range(dp) for start in ([0] if rank == 0 else [rank - 1])}
    planned_pairs = {(o, s) for o, s in zip(_aligned(p, kernel, "offset_ptr"), _aligned(p, kernel, "sz_ptr"))}
    assert dp == 4 and planned_pairs == pairs == {(True, True), (True, False), (False, True)}
    assert {c["offset_src"] for c in _constexprs(p, kernel)} == {False, True}


def test_the_draft_markov_sampling_covers_head_dtypes_and_key_classes(planned):
    """The DSPARK draft's ``MarkovSampleStep`` (once per draft position): the partial kernel at every Markov head
    dtype (its bias; the step dtype promoted with the bf16 base logits), greedy (argmax, nothing kept) and sampled
    (step logits kept), the Philox key both divisible by 16 and not; the finish kernel over the unsharded vocab."""
    _, p = planned
    module = "sglang.kernels.ops.speculative.dspark.markov_sample"
    partial = _constexprs(p, f"{module}:_markov_sample_partial_kernel")
    assert {(c["*B"], c["ROUND"], c["STORE"], c["SAMPLE"]) for c in partial} == {
        (bias, rounding, kept, kept) for bias, rounding in (("*bf16", 1), ("*fp16", 0), ("*fp32", 0))
        for kept in (False, True)}
    keys = [("tt.divisibility", 16) in c.parsed.args["KEY"].attrs
            for c in p.compiles if c.kernel == f"{module}:_markov_sample_partial_kernel"]
    assert set(keys) == {True, False}
    finish = _constexprs(p, f"{module}:_markov_sample_finish_kernel")
    assert {(c["PARTS"], c["WORLD"], c["BLOCK"]) for c in finish} == {(160, 1, 256)}  # cdiv(163840, 1024) parts


def test_the_req_to_token_writes_follow_the_pool_row_and_the_batch(planned):
    """The prefill's and every DSPARK decode step's req_to_token writes take the pool's row length as a constexpr:
    context + 4 + draft at page 1, and at least the decode reserve (2 x draft) + page - 1 above it (sglang 0.5.23's
    allocation_sizing); the decode step's also next_power_of_2(batch), every value up to the running-request cap."""
    import triton

    m, p = planned
    context, pages = m.spec()["sglang"]["model"]["context_length"], m.spec()["sglang"]["model"]["page_sizes"]
    widths, cap = m.spec()["serving"]["draft_widths"], m.spec()["serving"]["max_running_requests"]
    rows = {(page, d): context + (4 + d if page == 1 else max(4 + d, 2 * d + page - 1))
            for page in pages for d in widths}
    prefill = _constexprs(p, "sglang.kernels.ops.memory.common:write_req_to_token_pool_triton")
    assert {c["req_to_token_ptr_stride"] for c in prefill} == set(rows.values())
    decode = _constexprs(p, "sglang.srt.mem_cache.allocation:assign_req_to_token_pool")
    assert {(c["pool_len"], c["bs_upper"]) for c in decode} == {
        (row, triton.next_power_of_2(bs)) for row in rows.values() for bs in range(1, cap + 1)}


def test_the_bank_mix_and_the_sampled_accept_cover_their_constexprs(planned):
    """The attention-residual mix at every row count a layer reads (NB = next_power_of_2(valid rows + 1), 1 to
    cdiv(layers, attn_res_block_size) rows), K3's hidden size and norm epsilon; the sampled verify's rejection
    block sum at every batch size up to the cap (its batch_size constexpr) at each draft width, over the whole
    vocabulary."""
    import triton

    m, p = planned
    model = m.spec()["sglang"]["model"]
    rows = -(model["layers"] // -model["attn_res_block_size"])
    mix = _constexprs(p, "sgl_kernel_npu.kimi_k3.attn_residual:_mix_fused_kernel")
    assert {c["NB"] for c in mix} == {triton.next_power_of_2(v + 1) for v in range(1, rows + 1)}
    assert {(c["H"], c["EPS"]) for c in mix} == {(model["hidden_size"], model["rms_norm_eps"])}
    block_sum = _constexprs(p, "sgl_kernel_npu.sample.chain_speculative_sampling:_chain_rejection_block_sum_kernel")
    widths = m.spec()["serving"]["draft_widths"]
    assert {(c["batch_size"], c["num_draft_tokens"]) for c in block_sum} == {
        (bs, w) for bs in range(1, m.spec()["serving"]["max_running_requests"] + 1) for w in widths}
    assert {c["vocab_size"] for c in block_sum} == {model["vocab_size"]}


def test_without_the_model_table_only_the_kda_layers_are_planned_and_the_rest_is_named():
    """A manifest without ``[spec.sglang.model]`` (what `prewarm manifest` writes today) plans the KDA component
    alone, and the coverage report names every other component as not planned, saying why."""
    from prewarm.providers.sglang import ascend

    spec = {k: v for k, v in load(MANIFEST).spec().items()}
    spec["sglang"] = {k: v for k, v in spec["sglang"].items() if k != "model"}
    report = {c["component"]: c for c in ascend.coverage(spec)}
    for name in DRIVEN[1:]:
        (why,) = [item["why"] for item in report[name]["not_planned"] if "is absent" in item["why"]]
        assert report[name]["planned"] == [] and why.startswith("[spec.sglang.model] is absent")
