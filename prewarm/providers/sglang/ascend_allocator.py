"""The KV page allocator on sglang's Ascend path: the ``allocator`` component of :mod:`prewarm.providers.sglang.ascend`.

With ``--attention-backend ascend`` sglang 0.5.23 allocates KV slots with ``NPUPagedTokenToKVPoolAllocator``
(``srt/mem_cache/kv_cache_configurator.py``; ``srt/hardware_backend/npu/allocator_npu.py``). Its ``alloc_extend``
launches sgl-kernel-npu's ``mem_cache/allocator.py`` ``alloc_extend_kernel`` over the batch whenever fewer than 200
new pages are needed, with three constexprs: ``next_power_of_2(batch size)``, the page size and
``next_power_of_2(extend tokens)``. The scheduler reaches it (``srt/mem_cache/allocation.py``) for every prefill
batch at a page size above 1 (at page size 1 ``alloc_for_extend`` takes ``alloc_token_slots``, no kernel), and for
every speculative decode step's reservation at a page size above 1 (``alloc_for_spec_decode``: the batch's requests,
their reserved tokens).

:func:`calls` makes ``alloc_extend``'s launch with its arguments (the allocator module imports the scheduler's pool
stack, not assembled here), for both callers:

- ``alloc_for_extend``: int64 prefix and sequence lengths (``torch.tensor(..., dtype=torch.int64)``;
  ``ScheduleBatch.seq_lens``), ``last_loc`` as ``torch.cat`` leaves it (int64 where a request has no prefix, the
  req_to_token pool's int32 where every request has one); every ``(next_power_of_2(batch),
  next_power_of_2(tokens))`` pair with 1 <= batch <= the running-request cap and 1 <= tokens <= the prefill token
  budget needing fewer than 200 pages (:func:`shapes`);
- ``alloc_for_spec_decode`` (every DSPARK decode step whose reservation needs pages, ``DFlashDraftInputV2
  .prepare_for_decode``): the draft input's int32 current / next KV-length buffers and ``get_last_loc``'s int32 last
  locations (the ascend backend takes ``get_last_loc_torch``: ``torch.where`` over the int32 pool and lengths); at
  most ``2 x draft width + page - 1`` new tokens per request (``page_aligned_decode_alloc_lens``), so the tokens'
  power of two is bounded by the batch's (:func:`spec_decode_shapes`).

The free-page list is int64 (``clear``: ``torch.arange(..., dtype=torch.int64)``) and a view: each allocation leaves
``self.free_pages = self.free_pages[num_new_pages:]``, so after an odd count of pages handed out its pointer is not
16-byte aligned (another specialization class), aligned again after an even count or ``merge_and_sort_free``; both
are planned. int64 output.
"""
from __future__ import annotations

from typing import Callable, Iterator

COMPONENT = "allocator"
KERNEL = "sgl_kernel_npu.mem_cache.allocator:alloc_extend_kernel"
MAX_KERNEL_PAGES = 199  # NPUPagedTokenToKVPoolAllocator.alloc_extend: the kernel only below 200 new pages


def import_modules() -> None:
    import sgl_kernel_npu.mem_cache.allocator  # noqa: F401


def pow2_range(upto: int) -> list[int]:
    """``next_power_of_2(n)`` for every n in 1..``upto``."""
    return [1 << k for k in range(max(upto - 1, 0).bit_length() + 1)]


def shapes(s, page_size: int) -> list[tuple[int, int]]:
    """(bs_upper, max_num_extend_tokens) pairs the deployment reaches at ``page_size`` (> 1): a batch of up to the
    running-request cap, extending any token count up to the prefill budget and to what fewer than 200 pages hold
    (a prefill extends at least one token per request; a speculative decode's reservation may need tokens for a few
    of its requests only, so a count below the batch size is reached too)."""
    most_tokens = min(s.max_prefill_tokens, MAX_KERNEL_PAGES * page_size)
    return [(b, t) for b in pow2_range(s.max_batch) for t in pow2_range(most_tokens)]


def spec_decode_shapes(s, page_size: int) -> list[tuple[int, int]]:
    """(bs_upper, max_num_extend_tokens) pairs a DSPARK decode step's reservation reaches at ``page_size`` (> 1):
    each request needs at most ``2 x draft width + page - 1`` tokens (``page_aligned_decode_alloc_lens``: its next
    length rounds its committed length + the reserve up to a page), so a batch of up to ``bs_upper`` requests at most
    ``bs_upper`` times that; and fewer than 200 pages."""
    per_request = 2 * max(s.draft_widths) + page_size - 1
    return [(b, t) for b in pow2_range(s.max_batch)
            for t in pow2_range(min(b * per_request, MAX_KERNEL_PAGES * page_size))]


def calls(s, model) -> Iterator[tuple[str, Callable[[], object]]]:
    import torch

    i64, i32 = torch.int64, torch.int32
    for page in model.page_sizes:
        if page == 1:
            continue  # alloc_token_slots: no kernel
        # (caller, prefix / seq lengths' dtype, last_loc's dtype, its shapes)
        callers = [("extend", i64, i64, shapes(s, page)), ("extend", i64, i32, shapes(s, page))]
        if s.draft_widths:
            callers.append(("spec_decode", i32, i32, spec_decode_shapes(s, page)))
        for caller, lengths_dtype, last_loc_dtype, pairs in callers:
            for bs_upper, tokens_upper in pairs:
                for handed_out in (0, 1):  # pages handed out since the list was made: its view aligned or not
                    def call(page=page, bs=bs_upper, tokens=tokens_upper, lengths_dtype=lengths_dtype,
                             last_loc_dtype=last_loc_dtype, handed_out=handed_out):
                        _alloc_extend(bs, tokens, page, lengths_dtype, last_loc_dtype, handed_out)

                    yield (f"alloc_extend[{caller},page={page},bs_upper={bs_upper},tokens_upper={tokens_upper},"
                           f"last_loc={str(last_loc_dtype).rsplit('.', 1)[-1]},free_pages_offset={handed_out}]",
                           call)


def _alloc_extend(bs: int, tokens: int, page: int, lengths_dtype, last_loc_dtype, handed_out: int) -> None:
    """``NPUPagedTokenToKVPoolAllocator.alloc_extend``'s launch: ``bs`` requests (its ``next_power_of_2`` is ``bs``),
    ``tokens`` new tokens (likewise), the free-page list ``handed_out`` pages into its ``arange``."""
    import torch

    from sgl_kernel_npu.mem_cache.allocator import alloc_extend_kernel

    lengths = lambda dtype: torch.empty(bs, dtype=dtype, device="npu")  # noqa: E731
    free_pages = torch.empty(1024, dtype=torch.int64, device="npu")[handed_out:]
    out_indices = torch.empty(tokens, dtype=torch.int64, device="npu")
    alloc_extend_kernel[(bs,)](lengths(lengths_dtype), lengths(lengths_dtype), lengths(last_loc_dtype), free_pages,
                               out_indices, bs, page, tokens)


def coverage(s, model) -> dict:
    return {"component": COMPONENT, "planned": [KERNEL] if any(p > 1 for p in model.page_sizes) else [],
            "not_planned": [
                {"what": "NPUPagedTokenToKVPoolAllocator.alloc_decode, alloc_extend_naive (200 pages or more)",
                 "why": "torch operations, not Triton"}]}
