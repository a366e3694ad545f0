"""Seeded model-level steps of Kimi-Linear on vLLM 0.34.0 around its KDA layers: the MoE's Triton GEMMs and the V2
model runner's input-preparation and state-update kernels, within a manifest's envelope. The independent traffic
``tests/test_vllm_model.py`` checks the plan (``prewarm.providers.vllm.moe`` / ``.runner``) against.

Written from vLLM's sources, never from the provider (which this module does not import):

- the MoE as ``TritonExperts.apply`` (``fused_moe/experts/triton_moe.py``) runs one step of M tokens: M is the
  step's token count, or under a CUDA graph the capture size it is padded to (``--max-num-batched-tokens`` bounds
  it); the hidden states are rows ``[:M]`` of the graph's static buffer; the router (``grouped_topk``) hands int32
  ids and fp32 weights; the workspaces come from one buffer sized for the largest step (vLLM's workspace manager)
  and are cut by ``_resize_cache``; then ``try_get_optimal_moe_config``, ``_prepare_expert_assignment`` and the two
  ``invoke_fused_moe_triton_kernel`` calls (w13, then w2 with the router weights) as ``apply`` makes them;
- the sampler as ``Sampler.__call__`` -> ``_sample_random`` calls ``gumbel_sample``: the model's bf16 logits
  (``compute_logits``) where no request needs processing, else ``apply_sampling_params``' fp32 copy; greedy requests
  sample in the same kernel (temperature 0);
- the rejection sampler as ``RejectionSampler.__call__`` -> ``_verify`` calls ``rejection_sample`` (the default
  method): the same logits, the speculator's draft-logits cache (model dtype) when it drafts probabilistically,
  masked vocabulary blocks skipped when a request filters (top-k / top-p / min-p);
- the block tables as ``prepare_attn`` gathers them and computes the slot mappings (``BlockTables`` built for the
  hybrid allocator's groups, padded to the CUDA-graph size on a graph step);
- the runner as ``GPUModelRunner.prepare_inputs`` / ``postprocess_sampled`` / ``postprocess_num_computed_tokens``
  call ``input_batch.py``: ``idx_mapping`` int64 (``async_tensor_h2d(..., dtype=torch.int64)``), ``cu_num_logits``
  from the drafts each request verifies, the ``InputBuffers`` / ``RequestState`` / ``PenaltiesState`` buffers at
  the server's ``max_num_seqs``, ``max_model_len``, vocabulary, speculative steps; the sampler's
  ``get_num_sampled_and_rejected`` (ones) or the rejection sampler's (its accepted counts), then ``post_update``.

Each step draws its make-up (MoE eager or graph-padded, prefill, decode, spec with each request's own draft count),
the token and request counts (small ones often), which is how real traffic varies; the MoE's expert weights are the
model's ``[E, 2I, H]`` / ``[E, H, I]`` parameters.
"""
from __future__ import annotations

import importlib
import random
from typing import Iterator

from traffic import Call

FUSED_MOE = "vllm.model_executor.layers.fused_moe.fused_moe"
KINDS = ("moe", "moe_graph", "prefill", "decode", "spec")
CAPTURE_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))  # vLLM's default cudagraph sizes


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded model-level steps within ``spec``'s envelope."""
    steps = _Steps(spec, random.Random(seed), device)
    for i in range(n):
        yield steps.draw(i)


def kinds(spec: dict) -> list[str]:
    """The kinds :func:`calls` draws within ``spec``'s envelope."""
    return _Steps(spec, random.Random(0), "cpu").kinds


class _Steps:
    def __init__(self, spec: dict, rng: random.Random, device: str):
        import torch

        self.torch, self.rng, self.device = torch, rng, device
        serving, vllm = spec.get("serving", {}), spec.get("vllm", {})
        # the model's widths: the MoE's (config.json) and the runner's buffers (max_model_len, vocab_size)
        self.moe = {k.removeprefix("moe_"): v for k, v in vllm.items() if k.startswith("moe_")}
        self.runner = {k: vllm[k] for k in ("max_model_len", "vocab_size") if k in vllm}
        self.tp = spec.get("parallel", {}).get("tensor_parallel", 1)
        self.dtype = getattr(torch, spec.get("dtypes", {}).get("activation", "bfloat16"))
        self.max_tokens = serving.get("max_prefill_tokens") or 8192
        self.max_reqs = serving.get("max_running_requests") or max(serving.get("decode_batch_buckets") or [1])
        widths = [w for w in serving.get("draft_widths", []) if w > 1]
        self.num_spec = max(widths) - 1 if widths else 0
        self.kinds = [k for k in KINDS if (self.moe if k.startswith("moe") else self.runner)
                      and (k != "spec" or self.num_spec)]
        self.made = {}

    def tensor(self, key, *shape, dtype):
        if key not in self.made:
            self.made[key] = self.torch.zeros(*shape, dtype=dtype, device=self.device)
        return self.made[key]

    def draw(self, i: int) -> Call:
        rng = self.rng
        kind = rng.choice(self.kinds)
        if kind.startswith("moe"):
            tokens = rng.choice((rng.randrange(1, 65), rng.randrange(1, 600), rng.randrange(1, self.max_tokens + 1)))
            if kind == "moe_graph":
                tokens = next((c for c in CAPTURE_SIZES if c >= tokens and c <= self.max_tokens), tokens)
            return Call(f"step {i} {kind} tokens={tokens}", lambda t=tokens: self.moe_step(t),
                        {"kind": kind, "tokens": tokens})
        small = min(9, self.max_reqs + 1)
        reqs = rng.randrange(1, self.max_reqs + 1) if rng.random() < 0.5 else rng.randrange(1, small)
        drafts = [rng.randrange(0, self.num_spec + 1) for _ in range(reqs)] if kind == "spec" else None
        greedy = rng.random() < 0.5  # every request greedy (temperature 0), else sampled
        processed = not greedy or rng.random() < 0.2  # temperature != 1 or penalties: the logits are processed
        probabilistic = rng.random() < 0.5  # the drafter samples (its logits cached) or drafts greedily
        graph = kind != "prefill" and rng.random() < 0.5  # a decode / verify step replayed in a CUDA graph
        masked = not greedy and rng.random() < 0.5  # a request with top-k / top-p / min-p
        return Call(f"step {i} {kind} requests={reqs} greedy={greedy}",
                    lambda: self.runner_step(kind, reqs, drafts, processed, probabilistic, masked, graph),
                    {"kind": kind, "requests": reqs, "greedy": greedy, "processed": processed,
                     "probabilistic": probabilistic, "masked": masked, "graph": graph})

    # --- TritonExperts.apply --------------------------------------------------------------------------------------

    def moe_step(self, M: int):
        torch = self.torch
        fm = importlib.import_module(FUSED_MOE)
        utils = importlib.import_module("vllm.model_executor.layers.fused_moe.utils")
        align = importlib.import_module("vllm.model_executor.layers.fused_moe.moe_align_block_size")
        E, top_k, H = self.moe["experts"], self.moe["top_k"], self.moe["hidden_size"]
        inter = max(self.moe["intermediate_size"] // self.tp, 256)  # KimiMoE's padded partition
        w1 = self.tensor("w13_weight", E, 2 * inter, H, dtype=self.dtype)
        w2 = self.tensor("w2_weight", E, H, inter, dtype=self.dtype)
        hidden = self.tensor("static_hidden", self.max_tokens, H, dtype=self.dtype)[:M]
        topk_ids = torch.zeros(M, top_k, dtype=torch.int32, device=self.device)  # grouped_topk's int32 ids
        topk_weights = torch.zeros(M, top_k, dtype=torch.float32, device=self.device)
        N, K = w1.size(1), hidden.size(-1)
        big = self.tensor("workspace", self.max_tokens * top_k * max(N, K) * 2, dtype=self.dtype)
        ws13 = utils._resize_cache(big, (M, top_k, max(N // 2, K)))
        ws2 = utils._resize_cache(big, (M, top_k, max(N, K)))
        config = fm.try_get_optimal_moe_config(w1.size(), w2.size(), top_k, None, M)  # bf16: config_name None
        ic1 = utils._resize_cache(ws2, (M, top_k, N))
        ic2 = utils._resize_cache(ws13, (M * top_k, N // 2))
        ic3 = utils._resize_cache(ws2, (M, top_k, K))
        from torch._subclasses.fake_tensor import is_fake

        from traffic import fill_expert_alignment

        ops = align.ops

        class FilledByCudaOp:  # moe_align_block_size's C op writes into the wrapper's buffers; nothing to run here
            def __getattr__(self, name):
                return getattr(ops, name)

            def moe_align_block_size(self, ids, experts, block, sorted_ids, expert_ids, post_pad, *rest):
                if not is_fake(ids):  # on a GPU whose image lacks vLLM's _moe_C: its contents, in torch
                    fill_expert_alignment(ids, block, experts, sorted_ids, expert_ids, post_pad)

        align.ops = FilledByCudaOp()
        try:
            sorted_ids, expert_ids, padded = fm._prepare_expert_assignment(topk_ids, config, M, top_k, w1.shape[0],
                                                                           None)
        finally:
            align.ops = ops
        common = dict(compute_type=fm.tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                      use_int4_w4a16=False, per_channel_quant=False, block_shape=None)
        fm.invoke_fused_moe_triton_kernel(hidden, w1, ic1, None, None, None, sorted_ids, expert_ids, padded, False,
                                          top_k, config, B_bias=None, C_is_sorted=False, **common)
        fm.invoke_fused_moe_triton_kernel(ic2, w2, ic3, None, None, topk_weights, sorted_ids, expert_ids, padded,
                                          True, 1, config, B_bias=None, A_is_sorted=False, **common)

    # --- GPUModelRunner's steps -----------------------------------------------------------------------------------

    def block_tables(self):
        """``GPUModelRunner.initialize_kv_cache``'s ``BlockTables``: vLLM's hybrid allocator puts the 7 MLA layers in
        one group and the 20 KDA layers in groups of at most 7 (4 groups, one page size); the UVA-backed and
        staged-write members (host staging through vLLM's UVA op) are device tensors of their shapes and dtypes."""
        if "block_tables" in self.made:
            return self.made["block_tables"]
        import types

        bt = importlib.import_module("vllm.v1.worker.gpu.block_table")
        torch, dev = self.torch, self.device
        saved = {n: getattr(bt, n) for n in ("StagedWriteTensor", "UvaBackedTensor", "FusedStagedWriter")}
        bt.StagedWriteTensor = lambda size, dtype, device, **kw: types.SimpleNamespace(
            gpu=torch.zeros(size, dtype=dtype, device=device))
        bt.UvaBackedTensor = lambda size, dtype, **kw: types.SimpleNamespace(
            gpu=torch.zeros(size, dtype=dtype, device=dev))
        bt.FusedStagedWriter = lambda *a, **kw: None
        try:
            block = 1024 * self.rng.choice((1, 2, 4))
            width = 1 + self.num_spec
            self.made["block_tables"] = bt.BlockTables(
                [block] * 4, self.max_reqs, self.max_tokens,
                [-(-self.runner["max_model_len"] // block), width, width, width], torch.device(dev),
                slot_mapping_enabled=[True, False, False, False])
        finally:
            for n, v in saved.items():
                setattr(bt, n, v)
        return self.made["block_tables"]

    def runner_step(self, kind: str, reqs: int, drafts, processed: bool, probabilistic: bool = False,
                    masked: bool = False, graph: bool = False):
        torch = self.torch
        ib = importlib.import_module("vllm.v1.worker.gpu.input_batch")
        i32, i64 = torch.int32, torch.int64
        R, L, V, S = self.max_reqs, self.runner["max_model_len"], self.runner["vocab_size"], self.num_spec
        input_ids = self.tensor("input_ids", self.max_tokens, dtype=i32)
        positions = self.tensor("positions", self.max_tokens, dtype=i64)
        qsl_buf = self.tensor("query_start_loc", R + 1, dtype=i32)
        seq_lens_buf = self.tensor("seq_lens", R, dtype=i32)
        all_token_ids = self.tensor("all_token_ids", R, L, dtype=i32)
        prefill_len = self.tensor("prefill_len", R, dtype=i32)
        total_len = self.tensor("total_len", R, dtype=i32)
        computed = self.tensor("num_computed_tokens", R, dtype=i32)
        last_sampled = self.tensor("last_sampled_tokens", R, 1, dtype=i64)
        draft_table = self.tensor("draft_tokens", R, S, dtype=i64)
        next_prefill = self.tensor("next_prefill_tokens", 1, R, dtype=i32)
        bin_counts = self.tensor("output_bin_counts", R, V, dtype=i32)

        # the scheduler's batch, valid as a server's is (the same calls then run on a GPU): distinct request rows;
        # each request's new tokens (a prefill's chunk, a decode's one, a verify's 1 + drafts) within max_model_len
        rows = self.rng.sample(range(R), reqs)
        idx_mapping = torch.tensor(rows, dtype=i64, device=self.device)
        if kind == "prefill":
            lens = [self.rng.randint(1, max(1, self.max_tokens // reqs)) for _ in range(reqs)]
        else:
            lens = [1 + (drafts[j] if drafts else 0) for j in range(reqs)]
        done = [self.rng.randint(0, L - n - 2 - S) for n in lens]  # post_update appends up to 1 + S sampled
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        query_start_loc = qsl_buf[:reqs + 1]
        query_start_loc.copy_(torch.tensor(starts, dtype=i32))
        computed[idx_mapping] = torch.tensor(done, dtype=i32, device=self.device)
        prefill_len[idx_mapping] = torch.tensor([c + n if kind == "prefill" else c for c, n in zip(done, lens)],
                                                dtype=i32, device=self.device)
        total_len[idx_mapping] = torch.tensor([c + n for c, n in zip(done, lens)], dtype=i32, device=self.device)
        if drafts is None:
            total_logits = reqs
            cu_num_logits = torch.arange(reqs + 1, device=self.device, dtype=i32)
        else:
            total_logits = reqs + sum(drafts)
            cu_num_logits = torch.tensor([starts[j] for j in range(reqs + 1)], dtype=i32, device=self.device)
            expanded_idx_mapping, expanded_local_pos = ib.expand_idx_mapping(idx_mapping, total_logits,
                                                                             cu_num_logits, 1 + S)
        if kind == "prefill":
            ib.prepare_prefill_inputs(input_ids, next_prefill, idx_mapping, query_start_loc, all_token_ids,
                                      prefill_len, computed)
        ib.prepare_pos_seq_lens(idx_mapping, query_start_loc, computed, positions, seq_lens_buf)
        seq_lens = seq_lens_buf[:reqs]
        # prepare_attn: the block tables' rows for this batch and the slot mappings, padded for a CUDA graph
        tables = self.block_tables()
        padded_reqs = next((c for c in CAPTURE_SIZES if c >= reqs), reqs) if graph else reqs
        tables.gather_block_tables(idx_mapping, num_reqs_padded=padded_reqs, num_computed_tokens=computed)
        num_tokens = reqs + (sum(drafts) if drafts else 0)
        tables.compute_slot_mappings(idx_mapping, query_start_loc, positions,
                                     num_tokens_padded=next((c for c in CAPTURE_SIZES if c >= num_tokens),
                                                            num_tokens) if graph else num_tokens)
        logits_indices = ib.combine_sampled_and_draft_tokens(input_ids, idx_mapping, last_sampled, query_start_loc,
                                                             seq_lens, prefill_len, draft_table, cu_num_logits,
                                                             total_logits, 1)
        if drafts is None:  # Sampler.__call__
            gumbel = importlib.import_module("vllm.v1.worker.gpu.sample.gumbel")
            logits = torch.zeros(total_logits, V, dtype=self.dtype, device=self.device)  # compute_logits: bf16
            if processed:  # apply_sampling_params: a request with temperature / min-p / penalties: an fp32 copy
                logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
            gumbel.gumbel_sample(logits, idx_mapping, self.tensor("temperature", R, dtype=torch.float32),
                                 self.tensor("seeds", R, dtype=i64), positions[logits_indices],
                                 apply_temperature=False, is_drafting=False, use_fp64=False)
            num_sampled = seq_lens.new_ones(reqs)
            sampled = torch.zeros(reqs, 1, dtype=i64, device=self.device)
        else:  # RejectionSampler.__call__: gather_draft_sampled, then _verify -> rejection_sample
            rs = importlib.import_module("vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils")
            draft_sampled = input_ids.new_zeros(total_logits)  # gather_draft_sampled's outputs: token ids
            pos = positions.new_zeros(total_logits)
            logits = torch.zeros(total_logits, V, dtype=self.dtype, device=self.device)
            if processed:
                logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
            cache = None
            if probabilistic:  # Speculator._init_draft_logits: the head dtype (the model's), fill 0
                if "draft_logits" not in self.made:
                    dl = importlib.import_module("vllm.v1.worker.gpu.spec_decode.draft_logits")
                    self.made["draft_logits"] = dl.DraftLogitsCache(R, S, V, dtype=self.dtype, fill=0.0,
                                                                    device=self.device)
                cache = self.made["draft_logits"]
            sampled, num_sampled = rs.rejection_sample(
                logits, cache, draft_sampled, cu_num_logits, pos, idx_mapping, expanded_idx_mapping,
                expanded_local_pos, self.tensor("temperature", R, dtype=torch.float32),
                self.tensor("seeds", R, dtype=i64), S, None, use_fp64=False, use_block_verification=False,
                skip_masked_vocab_blocks=masked)
        num_sampled, num_rejected = ib.get_num_sampled_and_rejected(num_sampled, seq_lens, cu_num_logits,
                                                                    idx_mapping, prefill_len)
        ib.post_update(idx_mapping, computed, last_sampled, bin_counts, sampled, num_sampled, num_rejected,
                       query_start_loc, all_token_ids, total_len, None, draft_table)
        ib.post_update_num_computed_tokens(idx_mapping, computed, query_start_loc)
