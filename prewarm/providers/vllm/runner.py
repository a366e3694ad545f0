"""vLLM 0.34.0's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``) around the model: the component
``runner`` of ``prewarm.providers.vllm.kda``.

Each step the runner prepares its inputs and, after sampling, updates its request state with the Triton kernels of
``vllm/v1/worker/gpu/input_batch.py``, planned here by calling that module's functions as ``GPUModelRunner`` calls
them (``prepare_inputs``, ``postprocess_sampled``, ``postprocess_num_computed_tokens``; the sampler's and the
rejection sampler's ``get_num_sampled_and_rejected``), on the buffers the runner allocates
(``InputBuffers``, ``RequestState``: their shapes and dtypes; a UVA-backed host buffer stands as a device tensor of
the same dtype: the kernel gets a pointer either way): ``expand_idx_mapping`` (steps with drafts),
``prepare_prefill_inputs`` (steps with a prefill), ``prepare_pos_seq_lens``, ``combine_sampled_and_draft_tokens``,
``get_num_sampled_and_rejected``, ``post_update`` (with the penalties' ``output_bin_counts``, as the last pipeline
rank passes it), ``post_update_num_computed_tokens``; the logits processing ``Sampler.apply_sampling_params`` runs
(for the rejection sampler too) on the fp32 copy: the penalties processor's ``apply_penalties`` (and its
``bincount`` of a new request's tokens), ``apply_temperature`` and ``apply_min_p``; and the V2
``Sampler``'s Gumbel-max sampling
(``sample/gumbel.py``: ``gumbel_sample`` as ``Sampler._sample_random`` calls it, greedy and sampled requests alike:
temperature 0 is an argmax in the same kernel) on the model's bf16 logits, or their fp32 copy where a request needs
logits processing (temperature, min-p, penalties); on a step with drafts the rejection sampler's
``rejection_sample`` (``spec_decode/rejection_sampler_utils.py``, the default method) as ``RejectionSampler._verify``
calls it (after ``gather_draft_sampled``, whose logit count is an int Triton specializes: one logit is planned
too): on those logits, with no draft-logits cache (greedy drafts) or the speculator's ``DraftLogitsCache`` in
the head dtype (bf16, or fp32 where the head is), masked vocabulary blocks skipped or not (a request with top-k,
top-p or min-p).

Then, as ``prepare_attn`` does, ``BlockTables.gather_block_tables`` and ``compute_slot_mappings``
(``block_table.py``): a ``BlockTables`` built by its own ``__init__`` for the model's two KV-cache groups (MLA
attention, the KDA state), its staged-write and UVA-backed members standing as device tensors of the same shapes and
dtypes (their host staging needs vLLM's UVA op); group count and widths size grids and pointer tables only.

And the KV-block zeroer a hybrid model's runner holds (:func:`zero_calls`): each step it zeroes the attention blocks
the scheduler newly allocated, and block 0 at start-up (``vllm/v1/worker/utils.py`` ``KVBlockZeroer``).

What specializes these kernels is the deployment's geometry, not the batch: ``max_num_seqs`` (the buffers' rows),
``max_model_len`` (``all_token_ids``' row stride), the vocabulary (``output_bin_counts``' row), the speculative
steps (the draft table's row, the sampled-token row, the block constexprs); request counts only size grids.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

from prewarm_kernels.spec import SpecError

from ..capture import batch_sizes

INPUT_BATCH = "vllm.v1.worker.gpu.input_batch"
GUMBEL = "vllm.v1.worker.gpu.sample.gumbel"
MIN_P = "vllm.v1.worker.gpu.sample.min_p"
PENALTIES = "vllm.v1.worker.gpu.sample.penalties"
REJECTION = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
REJECTION_SAMPLER = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
BLOCK_TABLE = "vllm.v1.worker.gpu.block_table"
DRAFT_LOGITS = "vllm.v1.worker.gpu.spec_decode.draft_logits"
WORKER_UTILS = "vllm.v1.worker.utils"
REJECTION_KERNELS = ("_compute_local_logits_stats_kernel", "_rejection_kernel", "_resample_kernel",
                     "_insert_resampled_kernel")
KEYS = ("max_model_len", "vocab_size")
KERNELS = ("_prepare_prefill_inputs_kernel", "_prepare_pos_seq_lens_kernel", "_combine_sampled_and_draft_tokens_kernel",
           "_get_num_sampled_and_rejected_kernel", "_post_update_kernel", "_post_update_num_computed_tokens_kernel",
           "_expand_idx_mapping_kernel")
# the components a runner step's launches belong to, by the kernel's module (the rest: "runner")
COMPONENT_OF_MODULE = {GUMBEL: "sampler", MIN_P: "sampler", PENALTIES: "sampler", REJECTION: "rejection_sampler",
                       REJECTION_SAMPLER: "rejection_sampler"}
PLANNED = {"runner": [f"{INPUT_BATCH}:{k}" for k in KERNELS] + [f"{BLOCK_TABLE}:_gather_block_tables_kernel",
                                                                f"{BLOCK_TABLE}:_compute_slot_mappings_kernel",
                                                                f"{WORKER_UTILS}:_zero_kv_blocks_kernel"],
           "sampler": [f"{GUMBEL}:_gumbel_sample_kernel", f"{GUMBEL}:_gumbel_combine_kernel",
                       f"{GUMBEL}:_temperature_kernel", f"{MIN_P}:_min_p_kernel",
                       f"{PENALTIES}:_penalties_kernel", f"{PENALTIES}:_bincount_kernel"],
           "rejection_sampler": [f"{REJECTION}:{k}" for k in REJECTION_KERNELS] +
           [f"{REJECTION_SAMPLER}:_gather_draft_sampled_kernel"]}
WORKER = "vllm.v1.worker.gpu"
# per component, what the runner, its sampler and its speculative path launch that is not planned yet, and why
NOT_PLANNED = {"runner": [
    {"what": f"{WORKER}.cp_utils:_dcp_local_seq_lens_kernel, {WORKER}.mm.rope:_prepare_rope_positions_kernel, "
             f"{WORKER}.model_states.prompt_embeds:_apply_prompt_embeds_kernel",
     "why": "decode context parallelism, multimodal rope, prompt embeddings: not this deployment's (TP 1, a text "
            "model, token ids)"}],
    "sampler": [
    {"what": f"{GUMBEL}:_gumbel_sample_kernel with use_fp64_gumbel",
     "why": "not yet driven: --use-fp64-gumbel; temperature, min-p and the penalties are planned (the requests' "
            "other sampling options: component sampler_options)"},
    {"what": f"{WORKER}.metrics.logits:_num_nans_kernel",
     "why": "only with VLLM_COMPUTE_NANS_IN_LOGITS=1 (off by default)"},
    {"what": "FlashInfer's top-k/top-p sampling (the V2 Sampler's fused path)",
     "why": "a FlashInfer module past Triton, reached by sampled requests with top-k/top-p: not planned for vLLM"}],
    "rejection_sampler": [
    {"what": f"{REJECTION}: the block-verification, synthetic-rate, FLy and watermarking variants",
     "why": "other --speculative-config rejection_sample_method values or watermarking, not the default (the "
            "logprobs' _flatten_sampled_kernel: component sampler_options)"}]}


def component(kernel_module: str) -> str:
    """The component a runner step's launch of a kernel in ``kernel_module`` belongs to."""
    return COMPONENT_OF_MODULE.get(kernel_module, "runner")


# vLLM's ModelConfig.max_logprobs default (--max-logprobs 20): what a request's logprobs are validated against
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class RunnerSpec:
    """The model runner's geometry on one rank."""

    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    vocab_size: int
    num_spec: int
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs (-1: no cap, up to the vocabulary)


def read_spec(table: dict, max_num_reqs: int, max_num_tokens: int, num_spec: int) -> RunnerSpec | None:
    """``[spec.vllm]`` ``max_model_len`` (--max-model-len, else config.json's length as vLLM derives it) and
    ``vocab_size`` (config.json); None where neither is given (the runner's kernels not planned). Optional
    ``max_logprobs`` (--max-logprobs: the most logprobs a request may ask; absent: vLLM's default 20, -1: no cap)."""
    if not any(k in table for k in KEYS):
        return None
    for key in KEYS:
        value = table.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"vllm.{key}", value if key in table else ..., "a positive integer: max_model_len and "
                            "vocab_size are given together (the server's max_model_len, config.json vocab_size)")
    max_logprobs = table.get("max_logprobs", RunnerSpec.max_logprobs)
    if not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool) or max_logprobs < -1:
        raise SpecError("vllm.max_logprobs", max_logprobs, "an integer >= -1: the server's --max-logprobs (-1: no "
                        "cap)")
    return RunnerSpec(max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, num_spec=num_spec,
                      max_model_len=table["max_model_len"], vocab_size=table["vocab_size"],
                      max_logprobs=max_logprobs)


def calls(r: RunnerSpec, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call): one step's input preparation and post-sampling update per step kind and request count."""
    import importlib

    import torch

    ib = importlib.import_module(INPUT_BATCH)
    gumbel = importlib.import_module(GUMBEL)
    min_p = importlib.import_module(MIN_P)
    penalties = importlib.import_module(PENALTIES)
    rejection = importlib.import_module(REJECTION)
    rejection_sampler = importlib.import_module(REJECTION_SAMPLER)
    draft_logits = importlib.import_module(DRAFT_LOGITS)
    i32, i64 = torch.int32, torch.int64
    made = {}

    def buffers():
        if "b" not in made:
            z = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
            made["b"] = dict(
                # InputBuffers
                input_ids=z(r.max_num_tokens, dtype=i32), positions=z(r.max_num_tokens, dtype=i64),
                query_start_loc=z(r.max_num_reqs + 1, dtype=i32), seq_lens=z(r.max_num_reqs, dtype=i32),
                # RequestState
                all_token_ids=z(r.max_num_reqs, r.max_model_len, dtype=i32), prefill_len=z(r.max_num_reqs, dtype=i32),
                total_len=z(r.max_num_reqs, dtype=i32), num_computed_tokens=z(r.max_num_reqs, dtype=i32),
                last_sampled_tokens=z(r.max_num_reqs, 1, dtype=i64),
                draft_tokens=z(r.max_num_reqs, r.num_spec, dtype=i64),
                next_prefill_tokens=z(1, r.max_num_reqs, dtype=i32),
                # PenaltiesState
                output_bin_counts=z(r.max_num_reqs, r.vocab_size, dtype=i32),
                # SamplingStates
                temperature=z(r.max_num_reqs, dtype=torch.float32), seeds=z(r.max_num_reqs, dtype=i64),
                min_p=z(r.max_num_reqs, dtype=torch.float32),
                # PenaltiesState (its UVA-backed per-request tables as device tensors of their dtype)
                prompt_bin_mask=z(r.max_num_reqs, -(-r.vocab_size // 32), dtype=i32),
                **{f"{k}_penalty": z(r.max_num_reqs, dtype=torch.float32) for k in ("repetition", "frequency",
                                                                                    "presence")},
                prompt_len=z(r.max_num_reqs, dtype=i32))
        return made["b"]

    def caches():
        """The speculator's draft-logits cache (``Speculator._init_draft_logits``) in each head dtype."""
        if "caches" not in made:
            made["caches"] = [draft_logits.DraftLogitsCache(r.max_num_reqs, r.num_spec, r.vocab_size, dtype=dtype,
                                                            fill=0.0, device=device)
                              for dtype in (torch.bfloat16, torch.float32)]
        return made["caches"]

    def block_tables():
        if "bt" not in made:
            made["bt"] = _block_tables(importlib.import_module(BLOCK_TABLE), r, device)
        return made["bt"]

    kinds = ["prefill", "decode"] + (["spec"] if r.num_spec else [])
    for kind in kinds:
        for reqs in batch_sizes(r.max_num_reqs):
            def call(kind=kind, reqs=reqs):
                b = buffers()
                drafts = r.num_spec if kind == "spec" else 0
                idx_mapping = torch.zeros(reqs, dtype=i64, device=device)
                logits = reqs * (1 + drafts)
                cu_num_logits = torch.zeros(reqs + 1, dtype=i32, device=device)
                query_start_loc = b["query_start_loc"][:reqs + 1]
                expanded_idx_mapping = idx_mapping
                if kind == "spec":  # num_draft_tokens_per_req is not None
                    expanded_idx_mapping, expanded_local_pos = ib.expand_idx_mapping(
                        idx_mapping, logits, cu_num_logits, 1 + r.num_spec)
                if kind == "prefill":
                    ib.prepare_prefill_inputs(b["input_ids"], b["next_prefill_tokens"], idx_mapping, query_start_loc,
                                              b["all_token_ids"], b["prefill_len"], b["num_computed_tokens"])
                ib.prepare_pos_seq_lens(idx_mapping, query_start_loc, b["num_computed_tokens"], b["positions"],
                                        b["seq_lens"])
                seq_lens = b["seq_lens"][:reqs]
                tables = block_tables()  # prepare_attn
                tables.gather_block_tables(idx_mapping, num_reqs_padded=reqs,
                                           num_computed_tokens=b["num_computed_tokens"])
                tables.compute_slot_mappings(idx_mapping, query_start_loc, b["positions"],
                                             num_tokens_padded=reqs * (1 + drafts))
                logits_indices = ib.combine_sampled_and_draft_tokens(
                    b["input_ids"], idx_mapping, b["last_sampled_tokens"], query_start_loc, seq_lens, b["prefill_len"],
                    b["draft_tokens"], cu_num_logits, logits, 1)
                # Sampler.apply_sampling_params (the rejection sampler's too, on the verify rows): the logits' fp32
                # copy, then temperature (a request's neither 0 nor 1) and min-p in place
                processed = torch.zeros(logits, r.vocab_size, dtype=torch.float32, device=device)
                if kind == "prefill":  # PenaltiesState.apply_staged_writes: the new requests' token counts
                    penalties.bincount(idx_mapping, b["all_token_ids"], b["prompt_len"], b["prefill_len"],
                                       b["prompt_bin_mask"], b["output_bin_counts"], 1)
                local_pos = expanded_local_pos if kind == "spec" else torch.zeros(reqs, dtype=i32, device=device)
                penalties.apply_penalties(processed, expanded_idx_mapping, b["input_ids"], local_pos,
                                          b["repetition_penalty"], b["frequency_penalty"], b["presence_penalty"],
                                          b["prompt_bin_mask"], b["output_bin_counts"])
                gumbel.apply_temperature(processed, expanded_idx_mapping, b["temperature"])
                min_p.apply_min_p(processed, expanded_idx_mapping, b["min_p"])
                if kind != "spec":  # Sampler.__call__ -> _sample_random (the rejection sampler samples on its own)
                    pos = b["positions"][logits_indices]
                    for dtype in (torch.bfloat16, torch.float32):  # the model's logits, or their processed fp32 copy
                        gumbel.gumbel_sample(torch.zeros(logits, r.vocab_size, dtype=dtype, device=device),
                                             idx_mapping, b["temperature"], b["seeds"], pos, apply_temperature=False,
                                             is_drafting=False, use_fp64=False)
                # the sampler (no drafts: ones) or the rejection sampler (its own counts) -> the runner's update
                num_sampled = seq_lens.new_ones(reqs)
                sampled = torch.zeros(reqs, 1, dtype=i64, device=device)
                if kind == "spec":  # RejectionSampler.__call__ -> gather_draft_sampled -> _verify
                    draft_sampled, pos = rejection_sampler.gather_draft_sampled(
                        b["input_ids"], b["positions"], logits_indices, expanded_idx_mapping, expanded_local_pos,
                        b["prefill_len"])
                    for dtype, cache, skip in itertools.product((torch.bfloat16, torch.float32), (None, *caches()),
                                                                (False, True)):
                        sampled, num_sampled = rejection.rejection_sample(
                            torch.zeros(logits, r.vocab_size, dtype=dtype, device=device), cache, draft_sampled,
                            cu_num_logits, pos, idx_mapping, expanded_idx_mapping, expanded_local_pos,
                            b["temperature"], b["seeds"], r.num_spec, None, use_fp64=False,
                            use_block_verification=False, skip_masked_vocab_blocks=skip)
                num_sampled, num_rejected = ib.get_num_sampled_and_rejected(
                    num_sampled, seq_lens, cu_num_logits, idx_mapping, b["prefill_len"])
                ib.post_update(idx_mapping, b["num_computed_tokens"], b["last_sampled_tokens"], b["output_bin_counts"],
                               sampled, num_sampled, num_rejected, query_start_loc, b["all_token_ids"], b["total_len"],
                               None, b["draft_tokens"])
                ib.post_update_num_computed_tokens(idx_mapping, b["num_computed_tokens"], query_start_loc)

            yield f"runner[{kind},reqs={reqs},num_spec={r.num_spec}]", call
    if r.num_spec:
        # gather_draft_sampled's num_logits is an int Triton specializes (1, divisible by 16, other): a verify step of
        # one request with no drafts has one logit row
        def one_logit():
            b, i64 = buffers(), torch.int64
            rows = torch.zeros(1, dtype=i64, device=device)
            rejection_sampler.gather_draft_sampled(b["input_ids"], b["positions"], rows, rows,
                                                   torch.zeros(1, dtype=i32, device=device), b["prefill_len"])

        yield f"runner[spec,logits=1,num_spec={r.num_spec}]", one_logit


def zero_calls(page_bytes: list[int], device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call): the KV-block zeroing a hybrid model's runner launches (``vllm/v1/worker/utils.py``
    ``KVBlockZeroer``): a model with mamba layers sets ``KVCacheConfig.needs_kv_cache_zeroing``, the worker builds
    the runner's ``kv_block_zeroer``, its ``warmup`` zeroes block 0 at start-up and ``GPUModelRunner.update_requests``
    zeroes the attention blocks the scheduler newly allocated, each step. ``zero_block_ids`` runs here on a zeroer
    whose segment table is what ``init_meta`` builds for the attention layers (one segment per layer buffer: its
    address, block stride and page in int32 words, the hybrid's uniform page ``page_bytes``): the launch's constexpr
    ``BLOCK_SIZE`` is ``init_meta``'s own rule over the largest page, the block and segment counts size the grid."""
    import importlib
    import math

    import torch

    from .staged import pageable_h2d

    utils = importlib.import_module(WORKER_UTILS)
    for page in page_bytes:
        words = page // 4
        block = min(1 << (words - 1).bit_length(), 1024)  # init_meta: blk_size

        def call(words=words, block=block):
            zeroer = utils.KVBlockZeroer.__new__(utils.KVBlockZeroer)
            zeroer.device = torch.device(device)
            segments = 1
            zeroer._meta = (torch.zeros(segments, dtype=torch.uint64, device=device),
                            torch.full((segments,), words, dtype=torch.int64, device=device),
                            torch.full((segments,), words, dtype=torch.int64, device=device),
                            math.ceil(words / block), block, segments)
            with pageable_h2d(utils):  # the warm-up's block; a step's new blocks: the same launch, a wider grid
                zeroer.zero_block_ids([0])

        yield f"runner[zero_kv_blocks,page={page}]", call


def _block_tables(module, r: RunnerSpec, device: str):
    """``BlockTables`` as ``GPUModelRunner`` builds it for Kimi-Linear (an MLA attention group, a KDA state group:
    block size, then max blocks per request), its ``__init__`` run with ``StagedWriteTensor`` / ``UvaBackedTensor``
    standing as device tensors of the same shapes and dtypes (what the kernels read is ``.gpu``)."""
    import contextlib
    import types

    import torch

    def staged(size, dtype, device=device, **kwargs):
        return types.SimpleNamespace(gpu=torch.zeros(size, dtype=dtype, device=device))

    def uva_backed(size, dtype, **kwargs):
        return types.SimpleNamespace(gpu=torch.zeros(size, dtype=dtype, device=device))

    block = 2048  # the attention block (the hybrid page); no launch key depends on it
    with contextlib.ExitStack() as stack:
        for name, value in (("StagedWriteTensor", staged), ("UvaBackedTensor", uva_backed),
                            ("FusedStagedWriter", lambda *a, **k: None)):
            original = getattr(module, name)
            setattr(module, name, value)
            stack.callback(setattr, module, name, original)
        return module.BlockTables(block_sizes=[block, block], max_num_reqs=r.max_num_reqs,
                                  max_num_batched_tokens=r.max_num_tokens,
                                  max_num_blocks_per_group=[-(-r.max_model_len // block), 1 + r.num_spec],
                                  device=torch.device(device), slot_mapping_enabled=[True, False],
                                  dcp_sharded=[True, True], sliding_window_reach=[0, 0])
