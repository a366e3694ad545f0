"""The scheduler's req_to_token writes as sglang 0.5.23 makes them on CUDA: the scheduler side of the model component
``runner`` of ``prewarm.providers.sglang.cuda`` (the KDA provider's extend positions keep their label).

Every request's KV slots are listed in the request pool's ``req_to_token`` table (``ReqToTokenPool``: int32 ``[max
running requests + 1, context length + headroom]``, the row length sglang's ``get_req_to_token_extra_context_len``
sizes: ``4 + --speculative-num-draft-tokens`` at page size 1). Two Triton kernels write it, each taking the row length
as a constexpr (one compile per draft width of the deployment's launch lines):

- every prefill / chunked-prefill batch: ``ScheduleBatch.prepare_for_extend`` -> ``alloc_for_extend`` ->
  ``write_cache_indices`` (``srt/mem_cache/allocation.py``; Triton where the prefill attention backend supports it:
  fa3, the MLA backend on Hopper) -> ``sglang.kernels.ops.memory.common.write_req_to_token_pool_triton`` over int64
  request indices and prefix / sequence / extend lengths (``prepare_for_extend`` builds them int64), uint64 prefix
  pointers, and the new slots ``alloc_token_slots`` returns;
- every decode step under speculative decoding (``ScheduleBatch.prepare_for_decode`` -> ``spec_prepare_for_decode``
  -> ``eagle_prepare_for_decode`` -> ``alloc_for_spec_decode``) -> ``assign_req_to_token_pool_func`` ->
  ``sglang.srt.mem_cache.allocation.assign_req_to_token_pool``: int32 current / next KV lengths, int64 request
  indices; its second constexpr is ``next_power_of_2(batch size)``, so every power of two up to the largest decode
  batch is planned.

The new slots are a view of the page-1 allocator's free list (``TokenToKVPoolAllocator.alloc``: ``self.free_pages
[:need_size]``, the list then advancing past them): int64, starting at any element of it, so their data pointer is
16-byte aligned or 8 bytes off, two Triton specializations; both are planned. The other pointers are fresh tensors.
At page size 1 (sglang's default on CUDA; Kimi-Linear's fa3 MLA backend keeps it) ``get_last_loc`` is not called, and
a decode step without speculation writes the table with torch indexing (``alloc_for_decode_default``: nothing to
compile). ``write_cache_indices`` is sglang's own function; ``assign_req_to_token_pool_func`` is the call
``alloc_for_spec_decode`` makes.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Callable, Iterator

COMPONENT = "runner"
KERNELS = ("sglang.kernels.ops.memory.common:write_req_to_token_pool_triton",
           "sglang.srt.mem_cache.allocation:assign_req_to_token_pool")
# get_req_to_token_extra_context_len: the row headroom past the context length at page size 1
ROW_HEADROOM = 4
POOL_ROWS = 9  # the table's rows (max running requests + 1): a shape only, nothing specializes on it
ATTENTION_BACKEND = "fa3"  # the prefill backend write_cache_indices asks (sglang's default for MLA on Hopper)
NOT_PLANNED = [
    {"what": "sglang.kernels.ops.memory.common:get_last_loc_kernel",
     "why": "paged allocation only (alloc_for_extend / alloc_for_spec_decode at --page-size > 1): the plan is for "
            "page size 1, sglang's default on CUDA (the launch lines set no --page-size)"},
]


def context_length(spec: dict) -> int | None:
    """``[spec.sglang.model] context_length`` (sglang's ``model_config.context_len``: config.json's first of
    max_sequence_length, seq_length, max_seq_len, model_max_length, max_position_embeddings, or --context-length),
    None where absent. A bad value is a SpecError."""
    from prewarm_kernels.spec import SpecError

    value = ((spec.get("sglang") or {}).get("model") or {}).get("context_length")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise SpecError("sglang.model.context_length", value, "a positive integer: the model's context length as "
                        "sglang reads it (config.json model_max_length for Kimi-Linear, or --context-length)")
    return value


def row_lengths(s, context: int) -> list[int]:
    """The req_to_token row length of each launch line the manifest merges: the context length plus ``4 +
    --speculative-num-draft-tokens`` (``4`` without speculation)."""
    return sorted({context + ROW_HEADROOM + w for w in (s.draft_widths or (0,))})


def batch_uppers(s) -> list[int]:
    """``next_power_of_2(batch)`` for every decode batch 1..``s.max_batch`` (each value once)."""
    from sglang.srt.utils import next_power_of_2

    return sorted({next_power_of_2(b) for b in range(1, s.max_batch + 1)})


def calls(spec: dict, s, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) of the prefill write at each row length and slot alignment, and (with draft widths) the
    speculative decode reservation at each row length, slot alignment and ``bs_upper`` (none without
    ``[spec.sglang.model] context_length``)."""
    context = context_length(spec)
    if context is None:
        return
    for width in row_lengths(s, context):
        for aligned in (True, False):
            yield (f"{COMPONENT}/req_to_token_write[width={width},aligned={aligned}]",
                   lambda width=width, aligned=aligned: _extend_write(width, aligned, device))
        if not s.draft_widths:
            continue
        draft = width - context - ROW_HEADROOM
        for upper in batch_uppers(s):
            for aligned in (True, False):
                yield (f"{COMPONENT}/spec_decode_req_to_token[width={width},bs_upper={upper},aligned={aligned}]",
                       lambda width=width, upper=upper, aligned=aligned, draft=draft:
                       _spec_decode_write(width, upper, draft, aligned, device))


def _slots(count: int, aligned: bool, device: str):
    """``count`` new slots as the page-1 allocator hands them out: an int64 view of its free list, at an even
    (16-byte aligned) or odd element."""
    import torch

    offset = 0 if aligned else 1
    return torch.empty(count + 3, dtype=torch.int64, device=device)[offset:offset + count]


class _PrefixRow:
    """A request's matched prefix as ``write_cache_indices`` reads it: only its data pointer (a fake tensor has
    none), which sglang packs into the kernel's uint64 pointer table."""

    def data_ptr(self) -> int:
        return 0


def _extend_write(width: int, aligned: bool, device: str) -> None:
    """``alloc_for_extend``'s ``write_cache_indices`` for a batch of 3 requests (one with a cached prefix)."""
    import torch

    from sglang.srt.mem_cache import allocation

    batch, extend = 3, [5, 16, 7]
    lengths = lambda: torch.empty(batch, dtype=torch.int64, device=device)  # noqa: E731  (int64 .to(device))
    cpu = lambda: torch.empty(batch, dtype=torch.int64)  # noqa: E731
    pool = SimpleNamespace(req_to_token=torch.empty(POOL_ROWS, width, dtype=torch.int32, device=device),
                           device=device)
    with published_backends(allocation):
        allocation.write_cache_indices(_slots(sum(extend), aligned, device), lengths(), cpu(), lengths(), cpu(),
                                       lengths(), cpu(), lengths(), cpu(), [_PrefixRow() for _ in range(batch)], pool)


def _spec_decode_write(width: int, upper: int, draft: int, aligned: bool, device: str) -> None:
    """``alloc_for_spec_decode``'s reservation for a decode batch of ``upper`` requests (any batch with the same
    ``next_power_of_2`` launches the same kernel), each reserving 2 x the draft tokens."""
    import torch

    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func

    kv_lens = lambda: torch.empty(upper, dtype=torch.int32, device=device)  # noqa: E731  (int32 .to(device))
    assign_req_to_token_pool_func(torch.empty(upper, dtype=torch.int64, device=device),
                                  torch.empty(POOL_ROWS, width, dtype=torch.int32, device=device), kv_lens(),
                                  kv_lens(), _slots(upper * 2 * draft, aligned, device), upper)


@contextlib.contextmanager
def published_backends(allocation):
    """Within the block ``write_cache_indices`` reads the deployment's attention backends (fa3 prefill and decode) as
    a published server answers ``attention_backends()`` (the planner publishes no server: the accessor raises), and
    stages its host-side pointer table unpinned (pinning needs a CUDA driver; where the table is staged does not reach
    the kernel)."""
    originals = allocation.attention_backends, allocation.is_pin_memory_available
    allocation.attention_backends = lambda: (ATTENTION_BACKEND, ATTENTION_BACKEND)
    allocation.is_pin_memory_available = lambda device=None: False
    try:
        yield
    finally:
        allocation.attention_backends, allocation.is_pin_memory_available = originals


def coverage(spec: dict) -> dict:
    """This module's share of the ``runner`` component's coverage entry (the hook merges it with the KDA provider's
    extend positions)."""
    if context_length(spec) is None:
        return {"component": COMPONENT, "planned": [], "not_planned": [
            {"what": ", ".join(KERNELS) + " (the scheduler's req_to_token writes)",
             "why": "no [spec.sglang.model] context_length: the req_to_token row length (a constexpr) is not stated"}]}
    from .common import read_spec

    speculative = bool(read_spec(spec).draft_widths)  # without speculation a decode step writes with torch indexing
    return {"component": COMPONENT, "planned": list(KERNELS[:1 + speculative]),
            "not_planned": [dict(d) for d in NOT_PLANNED]}
