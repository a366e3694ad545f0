"""sglang 0.5.23's EAGLE worker (``EAGLEWorkerV2``, the only EAGLE worker 0.5.23 has: the overlap scheduler's) around
the target model, as it runs on CUDA: the model component ``spec_worker`` of ``prewarm.providers.sglang.cuda``.

Per decode step the worker (``srt/speculative/eagle_worker_v2.py`` and ``eagle_worker_common.py``) makes these Triton
launches, each through the sglang function :func:`calls` drives with the tensors the worker hands it:

- ``prepare_for_draft``: the draft's cache locations and positions (``assign_draft_cache_locs_contiguous_func``: the
  scheduler's int64 ``req_pool_indices`` / ``seq_lens``, the int32 ``req_to_token`` table, whose row pitch, context
  length + 4 + the draft width, is a constexpr; a chain plans the whole verify window, ``num_draft_tokens`` columns
  (the target runner's KV index translator always exists), a tree ``topk`` x ``num_steps`` slots at page size 1).
- ``draft_forward``: a chain's draft argmax at each inner step (``draft_topk1_postprocess`` over the draft's fp32
  ``[bs, vocab]`` logits, writing column ``i + 1`` of the int64 draft-token buffer); a tree's top-k is torch's.
- ``build_eagle_verify_input``: a chain's tree (``build_chain_tree``, which also writes the verify's cache
  locations: the full-attention backend's QLEN_ONLY verify-mask buffer, made with the CUDA graphs, where the batch fits
  them, its own above; int32 bonus tokens from the verify commit or int64 from the overlap scheduler's relay); a
  tree's is sglang's JIT ``speculative_tree`` module (past Triton: :mod:`.model_spec_jit`), its verify cache locations
  ``assign_extend_cache_locs_uniform_func`` (``eagle_prepare_for_verify``).
- after a tree verify, ``move_accept_tokens_to_target_kvcache`` (``fill_front_out_cache_loc_func``,
  ``fill_accept_out_cache_loc_func``) and the draft extend's inputs (``prepare_draft_extend_inputs``: a chain's come
  from the verify commit, planned by the KDA provider as ``eagle.verify_commit``).
- ``prepare_for_draft_extend``: the draft extend's lengths and positions (``prepare_draft_extend_layout``).
- the overlap scheduler's relay (``FutureMap.resolve_future``: ``gather_spec_extras``, topk_p / topk_index /
  bonus tokens / the draft's hidden states by ``req_pool_indices``).

The draft CUDA graph runners (``EAGLEDraftCudaGraphRunner``, ``EAGLEDraftExtendCudaGraphRunner``) capture the same
calls at each ``--cuda-graph-bs`` bucket and eager batches run any size up to ``--max-running-requests``: every call is
made at :func:`batch_sizes`. The chains are one per draft width (topk 1, ``num_steps`` = width - 1: sglang's
auto choice for a chain); with ``spec.sglang.eagle_tree`` trees of topk :data:`TREE_TOPK` (the KDA provider's tree
verify) at each ``num_steps`` 1..width - 1 (the verify commit's accept depths).
"""
from __future__ import annotations

from typing import Callable, Iterator

from ..capture import batch_sizes as _standing_sizes

COMPONENT = "spec_worker"
KERNELS = ("sglang.kernels.ops.speculative.cache_locs:assign_draft_cache_locs_contiguous",
           "sglang.kernels.ops.speculative.cache_locs:assign_extend_cache_locs",
           "sglang.kernels.ops.speculative.cache_locs:assign_extend_cache_locs_uniform",
           "sglang.kernels.ops.speculative.topk1:_draft_topk1_partial_argmax_kernel",
           "sglang.kernels.ops.speculative.topk1:_draft_topk1_finalize_kernel",
           "sglang.kernels.ops.speculative.eagle:_build_chain_tree_kernel",
           "sglang.kernels.ops.speculative.eagle:fill_accept_out_cache_loc",
           "sglang.kernels.ops.speculative.eagle:_draft_extend_inputs_kernel",
           "sglang.kernels.ops.speculative.eagle:_prepare_draft_extend_lengths_kernel",
           "sglang.kernels.ops.speculative.gather_spec_extras:_gather_rows_kernel")
# the KDA provider's verify commit (its labels keep eagle.verify_commit): part of this component
PROVIDER_KERNELS = ("sglang.kernels.ops.speculative.eagle:_verify_commit_outputs_kernel",)
# the kernels only a tree (topk > 1) launches, and those that take req_to_token's row pitch
TREE_KERNELS = {"assign_extend_cache_locs", "assign_extend_cache_locs_uniform", "fill_accept_out_cache_loc",
                "_draft_extend_inputs_kernel"}
CONTEXT_KERNELS = {"assign_draft_cache_locs_contiguous", "assign_extend_cache_locs_uniform", "_build_chain_tree_kernel"}
TREE_TOPK = 2  # --speculative-eagle-topk of a tree deployment (the KDA provider's tree verify plans topk 2)
REQ_TO_TOKEN_EXTRA = 4  # allocation_sizing.get_req_to_token_extra_context_len at page size 1: 4 + the draft width
NOT_PLANNED = [
    {"what": "the draft model's layers (EAGLE draft forward and draft extend)",
     "why": "Kimi-Linear ships no MTP/EAGLE head and sglang 0.5.23 has no Kimi-Linear draft architecture: the draft "
            "is a separate checkpoint (--speculative-draft-model-path, e.g. LlamaForCausalLMEagle: one decoder "
            "layer with MHA through the draft's attention backend, JIT RMSNorm / silu_and_mul) whose widths the "
            "manifest does not state"},
    {"what": "the draft's and draft extend's forward batches (ForwardBatch.init_new's positions, the draft attention "
             "backend's metadata)",
     "why": "the runner's and the draft attention backend's kernels at the draft's shapes, not driven here"},
    {"what": "a tree's top-k, select_top_k_tokens, organize_draft_results, the chain's draft-extend argmax",
     "why": "torch ops: nothing to compile"},
    {"what": "a tree's KV move after its verify (MLATokenToKVPool.move_kv_cache), the draft extend after a prefill",
     "why": "torch indexing and copies: nothing to compile"},
]


def _model(spec: dict) -> dict:
    return (spec.get("sglang") or {}).get("model") or {}


def trees(s) -> list[tuple[int, int, int]]:
    """(topk, num_steps, num_draft_tokens) of every draft the deployment runs: a chain per draft width and, with
    ``eagle_tree``, a tree of :data:`TREE_TOPK` at each depth."""
    out = [(1, w - 1, w) for w in s.draft_widths]
    if s.eagle_tree:
        out += [(TREE_TOPK, steps, w) for w in s.draft_widths for steps in range(1, w)]
    return out


def batch_sizes(s, depth: int = 0) -> list[int]:
    """The batch sizes that stand for every eager batch 1..max and every draft graph bucket; with ``depth`` (a tree's
    accepted-path width) also one for each pair of the constexprs the accepted-token move takes from the batch:
    ``next_power_of_2(bs)`` (``fill_front_out_cache_loc_func``) and ``next_power_of_2(bs x depth)``
    (``fill_accept_out_cache_loc_func``)."""
    sizes = set(_standing_sizes(s.max_batch)) | set(s.graph_buckets)
    if depth:
        pairs = {}
        for bs in range(1, s.max_batch + 1):
            pairs.setdefault((_next_pow2(bs), _next_pow2(bs * depth)), bs)
        sizes |= set(pairs.values())
    return sorted(sizes)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def calls(spec: dict, s, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) of the worker's launches for every draft of :func:`trees` at every :func:`batch_sizes` (none
    without draft widths). ``[spec.sglang.model]`` gives the widths they take: ``vocab_size`` (the draft argmax),
    ``hidden_size`` (the relayed hidden states), ``context_length`` (the chain tree's table pitch)."""
    from prewarm_kernels.spec import SpecError

    if not s.draft_widths:
        return
    model = _model(spec)
    for key in ("vocab_size", "hidden_size", "context_length"):
        v = model.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise SpecError(f"sglang.model.{key}", v, "a positive integer (config.json)")
    worker = _Worker(s, device, model)
    for topk, steps, width in trees(s):
        tag = f"topk={topk},steps={steps},draft={width}"
        for bs in batch_sizes(s):
            yield f"{COMPONENT}/draft[{tag},B={bs}]", lambda a=(topk, steps, width, bs): worker.draft(*a)
        for bs in batch_sizes(s, steps + 1 if topk > 1 else 0):
            yield f"{COMPONENT}/draft_extend[{tag},B={bs}]", lambda a=(topk, steps, width, bs): worker.extend(*a)
    if model.get("hidden_size"):
        for topk in sorted({t for t, _, _ in trees(s)}):
            for bs in batch_sizes(s):
                yield (f"{COMPONENT}/overlap_gather[topk={topk},B={bs}]",
                       lambda topk=topk, bs=bs: worker.gather(topk, bs))


class _Worker:
    """The worker's tensors as the scheduler and the pools hand them over (nothing runs: fake tensors)."""

    def __init__(self, s, device: str, model: dict):
        self.s, self.device, self.model = s, device, model
        self.pool_rows = s.max_batch + 1  # ReqToTokenPool: max_running_requests + 1 rows

    def _t(self, *shape, dtype):
        import torch

        return torch.zeros(*shape, dtype=dtype, device=self.device)

    def req_to_token(self, width: int):
        """The int32 ``[rows, context + 4 + draft width]`` table (None without ``context_length``)."""
        import torch

        context = self.model.get("context_length")
        return None if context is None else self._t(self.pool_rows, context + REQ_TO_TOKEN_EXTRA + width,
                                                    dtype=torch.int32)

    def draft(self, topk: int, steps: int, width: int, bs: int) -> None:
        """``prepare_for_draft``'s cache locations, ``draft_forward``'s chain argmax, ``build_eagle_verify_input``'s
        chain tree, a tree's verify cache locations (``eagle_prepare_for_verify``; a chain's come from its tree)."""
        import torch

        from sglang.kernels.ops.speculative.cache_locs import (assign_draft_cache_locs_contiguous_func,
                                                               assign_extend_cache_locs_uniform_func)

        rows = self._t(bs, dtype=torch.int64)
        seq_lens = self._t(bs, dtype=torch.int64)
        table = self.req_to_token(width)  # its row pitch is a constexpr of the cache-location kernels
        if table is not None:
            # a chain plans the whole verify window (the target runner's KV index translator always runs), a tree
            # its draft steps
            cols = width if topk == 1 else steps
            out = torch.empty(bs * topk * cols, dtype=torch.int64, device=self.device)
            assign_draft_cache_locs_contiguous_func(rows, table, seq_lens, out, topk, cols,
                                                    positions=torch.empty_like(seq_lens) if topk == 1 else None)
            if topk != 1:
                assign_extend_cache_locs_uniform_func(req_pool_indices=rows, req_to_token=table, start_offset=seq_lens,
                                                      batch_size=bs, draft_token_num=width, device=self.device)
        if topk != 1:
            return
        vocab = self.model.get("vocab_size")
        tokens = torch.empty(bs, steps, dtype=torch.int64, device=self.device)
        if vocab is not None:
            from sglang.kernels.ops.speculative.topk1 import draft_topk1_postprocess

            logits = self._t(bs, vocab, dtype=torch.float32)
            for column in range(1, steps):  # draft_forward's inner steps i = 0 .. steps - 2
                draft_topk1_postprocess(logits, torch.empty_like(seq_lens), tokens, column)
        if table is None:
            return
        from sglang.kernels.ops.speculative.eagle import build_chain_tree

        fits = self.s.graph_buckets and bs <= self.s.graph_buckets[-1]
        mask = self._t(self.s.graph_buckets[-1] * width * width, dtype=torch.bool) if fits else None
        for bonus_dtype in (torch.int32, torch.int64):  # the verify commit's, the overlap relay's
            build_chain_tree(self._t(bs, dtype=bonus_dtype), tokens, seq_lens, mask, req_pool_indices=rows,
                             req_to_token=table, with_mrope=False)

    def extend(self, topk: int, steps: int, width: int, bs: int) -> None:
        """After the verify: a tree's accepted-token move and draft-extend inputs, then ``prepare_for_draft_extend``'s
        layout."""
        import torch

        from sglang.kernels.ops.speculative.cache_locs import fill_front_out_cache_loc_func
        from sglang.kernels.ops.speculative.eagle import (fill_accept_out_cache_loc_func, prepare_draft_extend_inputs,
                                                          prepare_draft_extend_layout)

        if topk != 1:
            depth = steps + 1
            accept_lens = self._t(bs, dtype=torch.int32)
            out_cache_loc = self._t(bs * width, dtype=torch.int64)
            size = bs * depth
            fill_front_out_cache_loc_func(accept_lens, out_cache_loc, self._t(size, dtype=torch.int64))
            fill_accept_out_cache_loc_func(self._t(bs, depth, dtype=torch.int32), out_cache_loc,
                                           self._t(size, dtype=torch.int64), size)
            prepare_draft_extend_inputs(accept_lens, self._t(bs * width, dtype=torch.int32), width)
        prepare_draft_extend_layout(self._t(bs, dtype=torch.int64), width, False)

    def gather(self, topk: int, bs: int) -> None:
        """``FutureMap.resolve_future``: the relay buffers (one row per request-pool row) gathered by the batch's
        ``req_pool_indices``."""
        import torch

        from sglang.kernels.ops.speculative.gather_spec_extras import gather_spec_extras

        rows = self.pool_rows
        gather_spec_extras(self._t(bs, dtype=torch.int64), self._t(rows, topk, dtype=torch.float32),
                           self._t(rows, topk, dtype=torch.int64), self._t(rows, dtype=torch.int64),
                           self._t(rows, self.model["hidden_size"], dtype=torch.bfloat16))


def coverage(spec: dict) -> dict:
    """This component's entry of the provider's coverage hook."""
    from .common import read_spec

    s = read_spec(spec)
    if not s.draft_widths:
        return {"component": COMPONENT, "planned": [], "not_planned": [
            {"what": "the EAGLE worker", "why": "no spec.serving.draft_widths: no speculative decoding"}]}
    model = _model(spec)
    planned, missing = list(PROVIDER_KERNELS), [dict(d) for d in NOT_PLANNED]
    for kernel in KERNELS:
        name = kernel.split(":")[1]
        if name in TREE_KERNELS and not s.eagle_tree:
            continue  # a tree's only (topk > 1)
        if name.startswith("_draft_topk1") and model.get("vocab_size") is None:
            missing.append({"what": kernel, "why": "no [spec.sglang.model] vocab_size: the draft's logits width"})
        elif name in CONTEXT_KERNELS and model.get("context_length") is None:
            missing.append({"what": kernel, "why": "no [spec.sglang.model] context_length: req_to_token's row pitch "
                                                   "(a constexpr) is the context length + 4 + the draft width"})
        elif name == "_gather_rows_kernel" and model.get("hidden_size") is None:
            missing.append({"what": kernel, "why": "no [spec.sglang.model] hidden_size: the relayed hidden states"})
        else:
            planned.append(kernel)
    return {"component": COMPONENT, "planned": planned, "not_planned": missing}
