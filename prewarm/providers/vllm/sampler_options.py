"""vLLM 0.34.0's V2 sampler on requests' per-request options (OpenAI-API ``logit_bias``, ``allowed_token_ids``,
``min_tokens`` with stop tokens, ``bad_words``, ``logprobs`` / ``logprob_token_ids``, ``top_k`` / ``top_p`` beside a
greedy or explicitly seeded request): the component ``sampler_options`` of ``prewarm.providers.vllm.kda``.

Any deployment reaches these kernels as soon as one request carries the option; each compiles at first use. Planned
here by building the sampler's own option states (``LogitBiasState``, ``BadWordsState``, ``LogprobTokenIdsState``)
with their ``__init__`` on a ``RequestState`` built with its own (their UVA host buffers stood in as
:func:`prewarm.providers.vllm.staged.host_buffers` does), adding a request through their ``add_request`` and calling
them as ``Sampler`` / ``RejectionSampler`` do:

- ``apply_staged_writes`` (``Sampler.apply_staged_writes``): ``_apply_write_kernel`` on each option table, whose
  dtype and row stride specialize it (allowed / logit-bias token ids int32 and logit-bias values float32 at 1024 a
  row, stop token ids and logprob token ids int32 at 128, bad-word tokens int32 at 1024 and offsets at 129);
- ``apply`` (``Sampler.apply_sampling_params``: always on the logits' fp32 copy, the sampler's rows or the rejection
  sampler's verify rows): ``_bias_kernel`` with and without ``CHECK_ALL_MASKED_ROWS`` (on when a request with
  min-tokens has structured output), ``_bad_words_kernel``;
- ``compute_topk_scores`` (``Sampler.__call__``; ``RejectionSampler._get_logprobs_tensors`` after its
  ``_flatten_sampled_kernel``) on the model's bf16 logits (``--logprobs-mode raw_logprobs``, the default) or the
  processed fp32 copy (``processed_logprobs``), for every request-level logprob count up to ``max_logprobs``:
  ``_topk_log_softmax_kernel`` (``TOPK_BLOCK_SIZE`` and its specialized column count follow the count),
  ``_ranks_kernel``, and where a request names ``logprob_token_ids`` ``_fill_logprob_token_ids_kernel`` (constexprs
  ``NUM_TOPK`` = the batch's top count, ``PADDED_COLS`` = the widest row) with the logprobs over that width;
- ``StructuredOutputsWorker.apply_grammar_bitmask`` (``GPUModelRunner.sample``, before the sampler, on the model's
  bf16 logits): ``_apply_grammar_bitmask_kernel`` (``MASK_STRIDE`` = the runner's decode query length,
  1 + num_spec) for requests with structured output (:func:`_grammar_calls`);
- ``PromptLogprobsWorker.compute_prompt_logprobs`` (a request's ``prompt_logprobs``): the prompt's token gather
  (``_prompt_logprobs_token_ids_kernel``), then ``compute_topk_scores`` on the model's bf16 logits per chunk; and
  ``compute_prompt_token_id_logprobs`` (``prompt_logprob_token_ids``: 1..max_logprobs ids a row);
- ``apply_top_k_top_p`` (``Sampler._sample_random``, the rejection sampler's ``apply_sampling_params``): the Triton
  top-k / top-p masking (``vllm/v1/sample/ops/topk_topp_triton.py``) wherever a batch with top-k / top-p requests
  is not the fused FlashInfer sampler's (:func:`_top_k_top_p_calls`).

What specializes: the logits' dtype, the vocabulary (row stride and size), the logprob counts, the tables' fixed
widths, and for top-k / top-p the row count (1 or not; the split-row pipeline's split count); otherwise request
counts only size grids (planned over ``batch_sizes`` all the same).
"""
from __future__ import annotations

import importlib
import itertools
import types
from typing import Callable, Iterator

from ..capture import batch_sizes
from .runner import MAX_LOGPROBS

SAMPLE = "vllm.v1.worker.gpu.sample"
LOGIT_BIAS = f"{SAMPLE}.logit_bias"
BAD_WORDS = f"{SAMPLE}.bad_words"
LOGPROB = f"{SAMPLE}.logprob"
INTERFACE = f"{SAMPLE}.logits_processor.interface"
STATES = "vllm.v1.worker.gpu.states"
BUFFER_UTILS = "vllm.v1.worker.gpu.buffer_utils"
REJECTION_SAMPLER = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
PROMPT_LOGPROB = f"{SAMPLE}.prompt_logprob"
TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_triton"
STRUCTURED_OUTPUTS = "vllm.v1.worker.gpu.structured_outputs"
TOPK_TOPP_SAMPLER = "vllm.v1.sample.ops.topk_topp_sampler"
PLANNED = [f"{LOGIT_BIAS}:_bias_kernel", f"{BAD_WORDS}:_bad_words_kernel", f"{LOGPROB}:_topk_log_softmax_kernel",
           f"{LOGPROB}:_ranks_kernel", f"{LOGPROB}:_fill_logprob_token_ids_kernel",
           f"{REJECTION_SAMPLER}:_flatten_sampled_kernel",
           f"{BUFFER_UTILS}:_apply_write_kernel",  # the option tables: int32 at row 1024 / 128 / 129, float32 at 1024
           *(f"{TOPK_TOPP}:{k}" for k in ("_topk_topp_kernel", "_topp_sb_stats_kernel", "_topp_sb_step_kernel",
                                          "_topp_sb_mask_kernel")),
           f"{STRUCTURED_OUTPUTS}:_apply_grammar_bitmask_kernel", f"{PROMPT_LOGPROB}:_prompt_logprobs_token_ids_kernel"]
NOT_PLANNED = [
    {"what": f"{SAMPLE}.thinking_budget: the thinking-budget kernels",
     "why": "not this deployment's: ThinkingBudgetState is enabled only by a reasoning config (--reasoning-parser: "
            "its start / end marker token counts are the kernels' constexprs); the server passes none"},
    {"what": f"{SAMPLE}.output:_compact_sampling_mask_kernel",
     "why": "only with --return-sampling-mask (ModelConfig.return_sampling_mask, off by default; no request option "
            "reaches it)"},
]


def max_logprobs(r) -> int:
    """The most logprobs (and prompt logprobs, and prompt logprob token ids a row) a request may ask: the server's
    ``--max-logprobs`` (``[spec.vllm] max_logprobs``; vLLM's default :data:`MAX_LOGPROBS`); with -1 (no cap: any
    count up to the vocabulary, one compile per count) the default's range is planned and the rest named."""
    return MAX_LOGPROBS if r.max_logprobs < 0 else r.max_logprobs


def not_planned(r) -> list[dict]:
    """:data:`NOT_PLANNED`, and with ``--max-logprobs -1`` the counts above the planned range."""
    if r.max_logprobs >= 0:
        return NOT_PLANNED
    return NOT_PLANNED + [
        {"what": f"{LOGPROB}: logprob and prompt logprob counts above {MAX_LOGPROBS}",
         "why": "--max-logprobs -1: a request may ask any count up to the vocabulary, each count its own compile "
                "(not enumerable); state the deployment's real cap as --max-logprobs N to plan it"}]


def logprob_widths(max_logprobs: int, max_token_ids: int) -> list[tuple[int, int]]:
    """(num_logprobs, max_per_req_token_ids) pairs ``Sampler.get_logprobs_dims`` can return: every top count
    0..``max_logprobs`` alone (0: the sampled token's logprob only), and beside requests naming 1..``max_token_ids``
    token ids (one pair per width class ``compute_topk_scores`` launches with: its power-of-two padding and the
    gather's column count, an int Triton specializes on 1 and divisibility by 16)."""
    def cls(n):
        return 1 if n == 1 else 16 if n % 16 == 0 else 0

    def p2(n):
        return 1 << (n - 1).bit_length()

    out, seen = [], set()
    for k in range(max_logprobs + 1):
        out.append((k, 0))
        for m in range(1, max_token_ids + 1):
            cols = max(k, m)
            key = (k, p2(cols), p2(1 + cols), cls(1 + cols))
            if key not in seen:
                seen.add(key)
                out.append((k, m))
    return out


def calls(r, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call): the option tables' staged writes, the logits processing per step kind and request count, and
    the logprobs per logits dtype and width (``r``: :class:`prewarm.providers.vllm.runner.RunnerSpec`)."""
    import numpy as np
    import torch

    from . import staged

    logit_bias = importlib.import_module(LOGIT_BIAS)
    bad_words = importlib.import_module(BAD_WORDS)
    logprob = importlib.import_module(LOGPROB)
    interface = importlib.import_module(INTERFACE)
    states = importlib.import_module(STATES)
    rejection_sampler = importlib.import_module(REJECTION_SAMPLER)
    prompt_logprob = importlib.import_module(PROMPT_LOGPROB)
    sampling_params = importlib.import_module("vllm.sampling_params")
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    made = {}

    def options():
        """The sampler's option states on the runner's request state, request 0 carrying every option (its
        structured output on or off: the bias kernel's all-masked check), its writes staged."""
        if "o" not in made:
            rs = states.RequestState(max_num_reqs=r.max_num_reqs, max_model_len=r.max_model_len,
                                     max_num_batched_tokens=r.max_num_tokens, num_speculative_steps=r.num_spec,
                                     vocab_size=r.vocab_size, device=torch.device(device))
            rs.add_request("prewarm", 2, [0, 0], 0, 1)
            lp = interface.LogitsProcRequestState.from_request_state(rs)
            made["o"] = types.SimpleNamespace(
                rs=rs, bias=logit_bias.LogitBiasState(None, lp), bad=bad_words.BadWordsState(None, lp),
                token_ids=logprob.LogprobTokenIdsState(r.max_num_reqs, torch.device(device)))
        return made["o"]

    def request(structured: bool):
        """A request's sampling parameters with every option these states read (``SamplingParams``' fields)."""
        return types.SimpleNamespace(allowed_token_ids=[0, 1], logit_bias={0: 1.0}, min_tokens=4,
                                     all_stop_token_ids={2}, structured_outputs=object() if structured else None,
                                     bad_words_token_ids=[[0, 1], [2]], logprob_token_ids=[0, 1])

    def add(o, structured: bool):
        params = request(structured)
        o.bias.add_request(0, params)
        o.bad.add_request(0, params)
        o.token_ids.add_request(0, params)

    def tables():  # Sampler.apply_staged_writes after add_request
        with staged.host_buffers(device):
            o = options()
            add(o, structured=False)
            o.bias.apply_staged_writes()
            o.bad.apply_staged_writes()
            o.token_ids.apply_staged_writes()

    yield f"sampler_options[tables,max_num_reqs={r.max_num_reqs}]", tables

    kinds = ["sample"] + (["verify"] if r.num_spec else [])
    for kind, reqs, structured in itertools.product(kinds, batch_sizes(r.max_num_reqs), (False, True)):
        def process(kind=kind, reqs=reqs, structured=structured):
            with staged.host_buffers(device):
                o = options()
                add(o, structured)
                rows = reqs * (1 + (r.num_spec if kind == "verify" else 0))
                idx_mapping_np = np.zeros(reqs, dtype=np.intp)
                ctx = interface.LogitsContext(
                    expanded_idx_mapping=torch.zeros(rows, dtype=i64, device=device),
                    idx_mapping=torch.zeros(reqs, dtype=i64, device=device), idx_mapping_np=idx_mapping_np,
                    expanded_local_pos=torch.zeros(rows, dtype=i32, device=device),
                    input_ids=torch.zeros(rows, dtype=i32, device=device),
                    pos=torch.zeros(rows, dtype=i64, device=device),
                    seq_lens_upper_bound_np=idx_mapping_np)
                # Sampler.apply_sampling_params: the processors in pipeline order on the logits' fp32 copy
                logits = torch.zeros(rows, r.vocab_size, dtype=f32, device=device)
                o.bias.apply(logits, ctx)
                o.bad.apply(logits, ctx)

        yield f"sampler_options[{kind},reqs={reqs},structured_output={structured}]", process

    for dtype, (k, m) in itertools.product((torch.bfloat16, f32),
                                           logprob_widths(max_logprobs(r), sampling_params.MAX_LOGPROB_TOKEN_IDS)):
        def scores(dtype=dtype, k=k, m=m):
            with staged.host_buffers(device):
                o = options()
                reqs = 2
                logits = torch.zeros(reqs, r.vocab_size, dtype=dtype, device=device)
                sampled = torch.zeros(reqs, dtype=i64, device=device)
                logprob.compute_topk_scores(logits, k, sampled, [0, 1, 2], logprob_token_ids_state=o.token_ids,
                                            expanded_idx_mapping=torch.zeros(reqs, dtype=i64, device=device),
                                            max_per_req_token_ids=m, logits_mode=False)

        yield f"sampler_options[logprobs,logits={str(dtype).removeprefix('torch.')},k={k},token_ids={m}]", scores

    for k in range(max_logprobs(r) + 1):
        def prompt(k=k):
            """GPUModelRunner's prompt logprobs (PromptLogprobsWorker.compute_prompt_logprobs) for a prompt of two
            chunks (CHUNK_SIZE rows, then one) asking ``k`` logprobs: the token gather from the request state, then
            compute_topk_scores on each chunk of the model's bf16 logits (``compute_logits``: the LM head's matmul,
            no Triton, stood in by a tensor of its shape)."""
            with staged.host_buffers(device):
                o = options()
                worker = prompt_logprob.PromptLogprobsWorker(r.max_num_reqs, torch.device(device))
                worker.add_request("prompt", 0, types.SimpleNamespace(
                    prompt_logprobs=k, prompt_logprob_start=0, prompt_logprob_token_ids=None))
                tokens = prompt_logprob.CHUNK_SIZE + 1
                prompt_lens = np.full(r.max_num_reqs, tokens + 1, dtype=np.int32)
                batch = types.SimpleNamespace(
                    req_ids=["prompt"], idx_mapping_np=np.zeros(1, dtype=np.intp),
                    idx_mapping=torch.zeros(1, dtype=i64, device=device), num_tokens=tokens,
                    query_start_loc=torch.zeros(2, dtype=i32, device=device),
                    query_start_loc_np=np.array([0, tokens]), num_scheduled_tokens=np.array([tokens]),
                    num_computed_prefill_tokens_np=np.zeros(1, dtype=np.int32), prefill_len_np=prompt_lens[:1])
                worker.compute_prompt_logprobs(
                    lambda hidden: torch.zeros(hidden.shape[0], r.vocab_size, dtype=torch.bfloat16, device=device),
                    torch.zeros(tokens, 1, dtype=torch.bfloat16, device=device), batch, o.rs.all_token_ids.gpu,
                    o.rs.num_computed_tokens.gpu, prompt_lens)

        yield f"sampler_options[prompt_logprobs,k={k}]", prompt

    for ids in range(1, max_logprobs(r) + 1):  # validated: at most max_logprobs ids a row
        def prompt_ids(ids=ids):
            """PromptLogprobsWorker.compute_prompt_token_id_logprobs: a request's ``prompt_logprob_token_ids``
            ([rows, ids]) scored per chunk of the model's bf16 logits (compute_token_logprobs)."""
            worker = prompt_logprob.PromptLogprobsWorker(r.max_num_reqs, torch.device(device))
            tokens = prompt_logprob.CHUNK_SIZE + 2
            with staged.pageable_h2d(prompt_logprob):
                worker.add_request("prompt", 0, types.SimpleNamespace(
                    prompt_logprobs=None, prompt_logprob_start=0,
                    prompt_logprob_token_ids=np.zeros((tokens - 1, ids), dtype=np.int64)))
            prompt_lens = np.full(r.max_num_reqs, tokens, dtype=np.int32)
            # chunked prefill: a first chunk of one token, then the rest: a chunk's ids are a row slice of the
            # request's [rows, ids] int64 table, 16-byte aligned or not by its first row (odd ids past row 0: not)
            for chunk_start, scheduled in ((0, 1), (1, tokens - 1)):
                batch = types.SimpleNamespace(
                    req_ids=["prompt"], idx_mapping_np=np.zeros(1, dtype=np.intp),
                    query_start_loc_np=np.array([0, scheduled]), num_scheduled_tokens=np.array([scheduled]),
                    num_computed_prefill_tokens_np=np.full(1, chunk_start, dtype=np.int32),
                    prefill_len_np=prompt_lens[:1])
                worker.compute_prompt_token_id_logprobs(
                    lambda hidden: torch.zeros(hidden.shape[0], r.vocab_size, dtype=torch.bfloat16, device=device),
                    torch.zeros(scheduled, 1, dtype=torch.bfloat16, device=device), batch, prompt_lens)

        yield f"sampler_options[prompt_logprob_token_ids,ids={ids}]", prompt_ids

    yield from _top_k_top_p_calls(r, device)
    yield from _grammar_calls(r, device)

    if r.num_spec:
        for dtype, reqs in itertools.product((torch.bfloat16, f32), batch_sizes(r.max_num_reqs)):
            def verify_logprobs(dtype=dtype, reqs=reqs):
                """RejectionSampler._get_logprobs_tensors: the accepted tokens flattened, then their logprobs."""
                with staged.host_buffers(device):
                    o = options()
                    sampler = rejection_sampler.RejectionSampler.__new__(rejection_sampler.RejectionSampler)
                    sampler.sampler = types.SimpleNamespace(logprob_token_ids_state=o.token_ids,
                                                            logprobs_mode="raw_logprobs")
                    sampler.enable_adaptive_verification = False
                    rows = reqs * (1 + r.num_spec)
                    cu = list(range(0, rows + 1, 1 + r.num_spec))
                    sampler._get_logprobs_tensors(
                        torch.zeros(reqs, 1 + r.num_spec, dtype=i64, device=device),
                        torch.zeros(reqs, dtype=i32, device=device),
                        torch.zeros(rows, r.vocab_size, dtype=dtype, device=device),
                        torch.zeros(reqs + 1, dtype=i32, device=device), np.array(cu),
                        torch.zeros(rows, dtype=i64, device=device), (0, 0))

            yield (f"sampler_options[verify_logprobs,logits={str(dtype).removeprefix('torch.')},reqs={reqs},"
                   f"num_spec={r.num_spec}]", verify_logprobs)


def _top_k_top_p_calls(r, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call): ``Sampler._sample_random``'s Triton top-k / top-p masking (``apply_top_k_top_p`` on the
    processed fp32 logits, as ``SamplingStates.get_top_k_top_p`` hands the per-row k (int32) and p (float32)), and
    the rejection sampler's (``apply_sampling_params`` on its verify rows). Reached wherever a batch with top-k /
    top-p requests is not the fused FlashInfer sampler's (a greedy request or an explicit seed beside them, processed
    logprobs). Top-k only, top-p only (its rows all top-p only), both (with rows of top-p only or not): the
    constexprs ``TOPK_ENABLED`` / ``TOPP_ENABLED``; up to vLLM's split limit (``_SPLIT_MAX_BATCH`` rows) top-p takes
    the split-row pipeline, whose split count (a constexpr) follows the row count, the vocabulary and the SM count:
    every row count up to the limit, then ``batch_sizes`` of the verify rows."""
    import torch

    triton_ops = importlib.import_module(TOPK_TOPP)
    sampler_ops = importlib.import_module(TOPK_TOPP_SAMPLER)
    caches = (triton_ops._TRITON_TABLE_CACHE, triton_ops._TRITON_BUFFER_CACHE, triton_ops._TRITON_SPLIT_CACHE)
    max_rows = r.max_num_reqs * (1 + r.num_spec)
    rows_list = sorted({*range(1, min(triton_ops._SPLIT_MAX_BATCH, max_rows) + 1), *batch_sizes(max_rows)})
    # (top-k, top-p, has_topp_only_rows): get_top_k_top_p's outcomes
    modes = ((True, False, False), (False, True, True), (True, True, False), (True, True, True))
    for rows, (top_k, top_p, topp_only) in itertools.product(rows_list, modes):
        def call(rows=rows, top_k=top_k, top_p=top_p, topp_only=topp_only):
            for cache in caches:  # the module's per-device work buffers: a node's start empty
                cache.clear()
            try:
                sampler_ops.apply_top_k_top_p(
                    torch.zeros(rows, r.vocab_size, dtype=torch.float32, device=device),
                    torch.zeros(rows, dtype=torch.int32, device=device) if top_k else None,
                    torch.zeros(rows, dtype=torch.float32, device=device) if top_p else None,
                    has_topp_only_rows=topp_only)
            finally:
                for cache in caches:
                    cache.clear()

        yield f"sampler_options[top_k_top_p,rows={rows},top_k={top_k},top_p={top_p},topp_only={topp_only}]", call


def _grammar_calls(r, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call): ``StructuredOutputsWorker.apply_grammar_bitmask`` as ``GPUModelRunner.sample`` calls it on the
    model's bf16 logits, on a worker built by its own ``__init__`` (``max_num_logits`` = requests x decode query
    length, ``mask_stride`` = the decode query length: 1 + num_spec, a constexpr). Its side stream and pinned host
    copies need a driver: within the call ``torch.cuda``'s stream calls are no-ops and the host copies plain
    (:func:`prewarm.providers.vllm.staged.pageable_h2d`); neither is part of the launch's key."""
    import contextlib

    import numpy as np
    import torch

    from . import staged

    so = importlib.import_module(STRUCTURED_OUTPUTS)
    stride = 1 + r.num_spec  # GPUModelRunner.decode_query_len: the speculative steps + one sampled token

    class Stream:
        def wait_stream(self, other):
            return None

    for reqs in batch_sizes(r.max_num_reqs):
        def call(reqs=reqs):
            with contextlib.ExitStack() as stack:
                for owner, name, value in ((torch.cuda, "Stream", Stream), (torch.cuda, "current_stream", Stream),
                                           (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
                                           (so, "PIN_MEMORY", False)):
                    stack.callback(setattr, owner, name, getattr(owner, name))
                    setattr(owner, name, value)
                stack.enter_context(staged.pageable_h2d(so))
                worker = so.StructuredOutputsWorker(max_num_logits=r.max_num_reqs * stride, vocab_size=r.vocab_size,
                                                    device=torch.device(device), mask_stride=stride)
                batch = types.SimpleNamespace(req_ids=[str(i) for i in range(reqs)],
                                              cu_num_logits=torch.zeros(reqs + 1, dtype=torch.int32, device=device))
                logits = torch.zeros(reqs * stride, r.vocab_size, dtype=torch.bfloat16, device=device)
                words = -(-r.vocab_size // 32)
                worker.apply_grammar_bitmask(logits, batch, batch.req_ids,
                                             np.zeros((reqs * stride, words), dtype=np.int32))

        yield f"sampler_options[grammar_bitmask,reqs={reqs},mask_stride={stride}]", call
