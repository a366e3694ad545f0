"""vLLM 0.34.0's V2 sampler on requests' per-request options (logit bias / allowed token ids / min-tokens, bad words,
logprobs and logprob token ids, prompt logprobs, top-k / top-p beside greedy or seeded requests, structured output; on
the sampler's rows and the rejection sampler's verify rows) in the plan of the shipped H200 manifest
(``prewarm.providers.vllm.sampler_options``): each kernel with every variant vLLM's code launches, the variants read
from vLLM's sources (``sample/logit_bias.py``, ``bad_words.py``, ``logprob.py``, ``prompt_logprob.py``,
``spec_decode/rejection_sampler.py``, ``buffer_utils.py``, ``structured_outputs.py``,
``vllm/v1/sample/ops/topk_topp_triton.py``), not from the provider: a variant the plan loses fails here."""
from __future__ import annotations

from prewarm.building import tritoncompat
from prewarm.providers.vllm import kda
from prewarm.planning.manifest import load
from test_vllm_model import MANIFEST, planned  # noqa: F401  (the module's fixture: the shipped manifest's plan)

LOGPROB = "vllm.v1.worker.gpu.sample.logprob"
MAX_LOGPROBS = 20  # vLLM's ModelConfig.max_logprobs default: the deployment's --max-logprobs
MAX_LOGPROB_TOKEN_IDS = 128  # vllm/sampling_params.py: the most logprob_token_ids a request may name


def _specs(p, kernel: str) -> list:
    """The parsed specializations of the plan's compiles of ``module:kernel``."""
    return [tritoncompat.parse_specialization(c.specialization) for c in p.compiles if c.kernel == kernel]


def _int_class(arg) -> object:
    """An int argument's specialization class: 1, "16" (divisible by 16) or "other"."""
    if arg.type == "constexpr" or arg.value == 1:
        return arg.value
    return "16" if ("tt.divisibility", 16) in arg.attrs else "other"


def _p2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_logit_bias_and_bad_words_run_on_the_fp32_copy_with_and_without_the_all_masked_check(planned):
    """apply_sampling_params copies the logits to fp32 before its processors; _bias_kernel's CHECK_ALL_MASKED_ROWS is
    on when a min-tokens request has structured output (LogitBiasState.apply)."""
    _, p, _ = planned
    bias = _specs(p, "vllm.v1.worker.gpu.sample.logit_bias:_bias_kernel")
    assert {(s.args["logits_ptr"].type, s.args["BLOCK_SIZE"].value, s.args["CHECK_ALL_MASKED_ROWS"].value)
            for s in bias} == {("*fp32", 1024, False), ("*fp32", 1024, True)}
    bad = _specs(p, "vllm.v1.worker.gpu.sample.bad_words:_bad_words_kernel")
    assert {s.args["logits_ptr"].type for s in bad} == {"*fp32"}
    # the offsets table's row (VLLM_MAX_NUM_BAD_WORDS + 1 = 129) is not divisible by 16
    assert {_int_class(s.args["bad_word_offsets_stride"]) for s in bad} == {"other"}


def test_logprobs_at_every_count_on_the_model_logits_and_the_processed_copy(planned):
    """compute_topk_scores gathers 1 + max(num_logprobs, max_per_req_token_ids) columns: _topk_log_softmax_kernel's
    TOPK_BLOCK_SIZE is their power of two (<= 1024) and the count an int Triton specializes; the raw (bf16) and the
    processed (fp32) logits (--logprobs-mode); _fill_logprob_token_ids_kernel's NUM_TOPK / PADDED_COLS where a
    request names token ids; _ranks_kernel per dtype."""
    _, p, _ = planned
    widths = range(1, 1 + 1 + max(MAX_LOGPROBS, MAX_LOGPROB_TOKEN_IDS))
    want = {(dtype, min(_p2(n), 1024), 1 if n == 1 else "16" if n % 16 == 0 else "other")
            for dtype in ("*bf16", "*fp32") for n in widths}
    got = {(s.args["logits_ptr"].type, s.args["TOPK_BLOCK_SIZE"].value, _int_class(s.args["topk"]))
           for s in _specs(p, f"{LOGPROB}:_topk_log_softmax_kernel")}
    assert want <= got, sorted(want - got, key=str)
    fill = {(s.args["NUM_TOPK"].value, s.args["PADDED_COLS"].value)
            for s in _specs(p, f"{LOGPROB}:_fill_logprob_token_ids_kernel")}
    want = {(k, _p2(max(k, m))) for k in range(MAX_LOGPROBS + 1) for m in range(1, MAX_LOGPROB_TOKEN_IDS + 1)}
    assert want <= fill, sorted(want - fill)
    assert {s.args["logits_ptr"].type for s in _specs(p, f"{LOGPROB}:_ranks_kernel")} == {"*bf16", "*fp32"}


def test_the_rejection_sampler_flattens_its_accepted_tokens_for_logprobs(planned):
    """RejectionSampler._get_logprobs_tensors: sampled [requests, 1 + num_spec] int64, num_sampled int32."""
    _, p, _ = planned
    flat = _specs(p, "vllm.v1.worker.gpu.spec_decode.rejection_sampler:_flatten_sampled_kernel")
    assert {(s.args["sampled_ptr"].type, s.args["num_sampled_ptr"].type) for s in flat} == {("*i64", "*i32")}


def test_the_option_tables_staged_writes(planned):
    """Sampler.apply_staged_writes: _apply_write_kernel on the logit-bias values (float32, row 1024) and on an int32
    table whose row is not divisible by 16 (the bad-word offsets, 129), besides the int32 tables at 1024 / 128."""
    _, p, _ = planned
    labels = {c.label for c in p.compiles if c.kernel.endswith("buffer_utils:_apply_write_kernel")}
    assert any(label.startswith("sampler_options/") for label in labels)
    writes = {(s.args["output_ptr"].type, _int_class(s.args["output_stride"]))
              for s in _specs(p, "vllm.v1.worker.gpu.buffer_utils:_apply_write_kernel")}
    assert {("*fp32", "16"), ("*i32", "other"), ("*i32", "16")} <= writes


def test_coverage_lists_the_component():
    rows = {row["component"]: row for row in kda.coverage(load(MANIFEST).spec())}
    options = rows["sampler_options"]
    assert any(k.endswith(":_bias_kernel") for k in options["planned"])
    assert all(item["why"] for item in options["not_planned"])
    # what is planned here is no longer listed as not planned by the runner's rows
    others = " ".join(item["what"] for name in ("sampler", "rejection_sampler", "staged")
                      for item in rows[name]["not_planned"])
    assert not any(name in others for name in ("_flatten_sampled_kernel", "logit-bias", "logit bias", "logprob",
                                               "bad-words", "option tables"))


def test_an_uncapped_max_logprobs_names_the_counts_it_cannot_plan():
    """--max-logprobs -1: a request may ask any count up to the vocabulary (each its own compile); the coverage row
    says the counts above vLLM's default are not planned, and a bad value is refused naming the key."""
    import pytest

    from prewarm_kernels.spec import SpecError

    spec = load(MANIFEST).spec()
    def row(value):
        s = {**spec, "vllm": {**spec["vllm"], "max_logprobs": value}}
        return {r["component"]: r for r in kda.coverage(s)}["sampler_options"]["not_planned"]

    assert not any("above 20" in item["what"] for item in row(24))
    assert any("above 20" in item["what"] and "--max-logprobs -1" in item["why"] for item in row(-1))
    with pytest.raises(SpecError, match="spec.vllm.max_logprobs"):
        row(-2)


def test_top_k_top_p_masking_for_each_option_and_the_split_pipeline(planned):
    """apply_top_k_top_p_triton (topk_topp_triton.py): the monolithic kernel with top-k only, top-p only, both
    (TOPK_ENABLED / TOPP_ENABLED; SPLIT_COVERS_PONLY where top-p runs at <= _SPLIT_MAX_BATCH = 64 rows), at one row
    and more (BATCH_SIZE specializes on 1 only); top-p at <= 64 rows takes the split-row pipeline with and without
    top-k (HAS_K), its split count S = _topp_split_count(rows, vocabulary 163840, the H200's 132 SMs): 32 up to 4
    rows, 16 above."""
    _, p, _ = planned
    ops = "vllm.v1.sample.ops.topk_topp_triton"
    mono = {(s.args["TOPK_ENABLED"].value, s.args["TOPP_ENABLED"].value, s.args["SPLIT_COVERS_PONLY"].value,
             _int_class(s.args["BATCH_SIZE"])) for s in _specs(p, f"{ops}:_topk_topp_kernel")}
    want = {(True, False, False, 1), (True, False, False, "other"), (True, True, True, 1), (True, True, True, "other"),
            (False, True, False, "other"), (True, True, False, "other")}  # the last two: above 64 rows
    assert want <= mono, sorted(want - mono, key=str)
    for kernel in ("_topp_sb_stats_kernel", "_topp_sb_step_kernel", "_topp_sb_mask_kernel"):
        got = {(s.args["HAS_K"].value, s.args["S"].value) for s in _specs(p, f"{ops}:{kernel}")}
        assert got == {(has_k, splits) for has_k in (False, True) for splits in (16, 32)}, kernel


def test_structured_output_masks_the_model_logits_at_the_decode_query_length(planned):
    """GPUModelRunner.sample applies the grammar bitmask to the model's bf16 logits before sampling
    (StructuredOutputsWorker, mask_stride = decode_query_len: 1 + the manifest's 3 MTP tokens)."""
    _, p, _ = planned
    masks = _specs(p, "vllm.v1.worker.gpu.structured_outputs:_apply_grammar_bitmask_kernel")
    assert {(s.args["logits_ptr"].type, s.args["MASK_STRIDE"].value, s.args["BLOCK_SIZE"].value)
            for s in masks} == {("*bf16", 4, 8192)}
    # the bitmask's row: cdiv(vocabulary 163840, 32) words
    assert {_int_class(s.args["bitmask_stride"]) for s in masks} == {"16"}


def test_prompt_logprobs_gather_the_prompt_from_the_request_state(planned):
    """PromptLogprobsWorker.compute_prompt_logprobs: _prompt_logprobs_token_ids_kernel reads the request state's
    token history (int32, row max_model_len = 1048576) into int64 token ids, BLOCK_SIZE 1024."""
    _, p, _ = planned
    gathers = _specs(p, "vllm.v1.worker.gpu.sample.prompt_logprob:_prompt_logprobs_token_ids_kernel")
    assert {(s.args["prompt_logprobs_token_ids_ptr"].type, s.args["all_token_ids_ptr"].type,
             _int_class(s.args["all_token_ids_stride"]), s.args["BLOCK_SIZE"].value)
            for s in gathers} == {("*i64", "*i32", "16", 1024)}
