"""The model runner's and scheduler's own kernels around Kimi K3's layers on sglang's Ascend path: the ``runner``
component of :mod:`prewarm.providers.sglang.ascend`.

torch_npu's ``transfer_to_npu`` makes ``tensor.is_cuda`` true, and sglang's NPU platform says it supports Triton
(``srt/platforms/npu.py``: ``supports_triton=True``), so the runner's and scheduler's Triton paths run on the NPU:

- extend positions: ``ForwardBatch.init_new`` -> ``compute_position`` -> ``support_triton("ascend")`` ->
  ``sglang.kernels.ops.attention.position.compute_position_triton`` over int32 prefix and extend lengths (every
  extend: prefill, chunked prefill, DSPARK's draft extend);
- the req_to_token write of every prefill batch: ``alloc_for_extend`` -> ``write_cache_indices`` ->
  ``support_triton`` -> ``sglang.kernels.ops.memory.common.write_req_to_token_pool_triton`` (int32 pool rows whose
  length is a constexpr: :func:`prewarm.providers.sglang.ascend_model.req_to_token_width`; int64 request indices and
  lengths, uint64 prefix pointers; the new slots as the allocator returns them: int64 at page size 1
  (``alloc_token_slots``), int32 above (``NPUPagedTokenToKVPoolAllocator.alloc_extend``: ``.int()``));
- every DSPARK decode step's reservation (``DFlashDraftInputV2.prepare_for_decode`` -> ``alloc_for_spec_decode`` ->
  ``assign_req_to_token_pool_func``: ``sglang.srt.mem_cache.allocation.assign_req_to_token_pool``, constexprs the
  req_to_token row length and ``next_power_of_2(batch)``; int32 current / next KV lengths (the draft input's
  buffers), int64 request indices, the new slots as above);
- DP attention's gather and scatter (``srt/layers/dp_attention.py``: ``_dp_gather_via_all_reduce`` / ``dp_scatter``
  -> ``memcpy_triton``): the layers' bf16 hidden rows (the dense MLP's gather, the logits' gather) and the
  LM head's logits back, into and out of the DP-gathered buffer; the offset and count are the DP rank's entries of
  the int64 token-count tensor and its cumsum (``get_dp_local_info``: 0-d views ``cumtokens[rank - 1]``,
  ``global_num_tokens_gpu[rank]``, rank 0's offset a fresh zero), so on some DP ranks one of them sits at a pointer
  that is not 16-byte aligned: every DP rank is planned.

Each kernel is the wheel's; ``assign_req_to_token_pool_func`` is sglang's own function, the other launches are made
with the arguments their callers pass (``write_cache_indices`` reads the published attention backends and the prefix
tensors' data pointers, which a fake tensor has not; ``ForwardBatch`` and ``dp_attention`` import the serving stack).
"""
from __future__ import annotations

from typing import Callable, Iterator

from .ascend_allocator import pow2_range
from .ascend_model import req_to_token_width

COMPONENT = "runner"
POSITIONS = "sglang.kernels.ops.attention.position:compute_position_kernel"
REQ_TO_TOKEN = "sglang.kernels.ops.memory.common:write_req_to_token_pool_triton"
MEMCPY = "sglang.kernels.ops.memory.memcpy_triton:memcpy_triton_kernel"
RESERVE = "sglang.srt.mem_cache.allocation:assign_req_to_token_pool"
POOL_ROWS = 66  # req_to_token rows: a shape only


def import_modules() -> None:
    import sglang.kernels.ops.attention.position  # noqa: F401
    import sglang.kernels.ops.memory.common  # noqa: F401
    import sglang.kernels.ops.memory.memcpy_triton  # noqa: F401
    import sglang.srt.mem_cache.allocation  # noqa: F401


def calls(s, model) -> Iterator[tuple[str, Callable[[], object]]]:
    import torch

    from sglang.kernels.ops.attention.position import compute_position_triton
    from sglang.kernels.ops.memory.common import write_req_to_token_pool_triton
    from sglang.kernels.ops.memory.memcpy_triton import memcpy_triton
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func

    from ..capture import index_tensor

    def positions():
        lengths = [1, 67]
        compute_position_triton(index_tensor([0, 64], torch.int32, "npu"), index_tensor(lengths, torch.int32, "npu"),
                                sum(lengths))

    yield "extend_positions", positions
    for page in model.page_sizes:
        slots = torch.int64 if page == 1 else torch.int32
        for draft in s.draft_widths or (0,):
            width = req_to_token_width(model, page, draft)

            def write(width=width, slots=slots, batch=3):
                lengths = lambda: torch.empty(batch, dtype=torch.int64, device="npu")  # noqa: E731
                write_req_to_token_pool_triton[(batch,)](
                    torch.empty(POOL_ROWS, width, dtype=torch.int32, device="npu"), lengths(),
                    torch.empty(batch, dtype=torch.uint64, device="npu"), lengths(), lengths(), lengths(),
                    torch.empty(40, dtype=slots, device="npu"), width)

            yield f"req_to_token_write[page={page},draft={draft},width={width}]", write
            if not draft:
                continue
            for batch in pow2_range(s.max_batch):  # bs_upper = next_power_of_2(batch): each value once
                def reserve(width=width, slots=slots, batch=batch):
                    lengths = lambda: torch.empty(batch, dtype=torch.int32, device="npu")  # noqa: E731
                    assign_req_to_token_pool_func(
                        torch.empty(batch, dtype=torch.int64, device="npu"),
                        torch.empty(POOL_ROWS, width, dtype=torch.int32, device="npu"), lengths(), lengths(),
                        torch.empty(batch * draft, dtype=slots, device="npu"), batch)

                yield f"spec_decode_req_to_token[page={page},draft={draft},width={width},bs_upper={batch}]", reserve

    def gather_scatter(dtype, width, rank):
        counts = torch.empty(model.attention_dp, dtype=torch.int64, device="npu")  # global_num_tokens_gpu
        cumtokens = torch.cumsum(counts, dim=0)
        # get_dp_local_info on DP rank ``rank``
        start = torch.zeros_like(cumtokens[0]) if rank == 0 else cumtokens[rank - 1]
        count = counts[rank]
        local = torch.empty(5, width, dtype=dtype, device="npu")
        whole = torch.empty(20, width, dtype=dtype, device="npu")
        memcpy_triton(whole, local, 0, start, count, False)  # _dp_gather_via_all_reduce
        memcpy_triton(local, whole, 0, start, count, True)  # dp_scatter

    for rank in range(model.attention_dp):
        yield (f"dp_gather_scatter[hidden,dp_rank={rank}]",
               lambda rank=rank: gather_scatter(torch.bfloat16, model.hidden_size, rank))
        for dtype in (torch.bfloat16, torch.float32):  # the LM head's logits, before and after their fp32 cast
            yield (f"dp_gather_scatter[logits,{str(dtype).rsplit('.', 1)[-1]},dp_rank={rank}]",
                   lambda dtype=dtype, rank=rank: gather_scatter(dtype, model.vocab_size // model.tensor_parallel,
                                                                 rank))


def coverage(s, model) -> dict:
    planned = [POSITIONS, REQ_TO_TOKEN, MEMCPY] + ([RESERVE] if s.draft_widths else [])
    return {"component": COMPONENT, "planned": planned, "not_planned": [
        {"what": "sglang.srt.layers.dp_attention:_mask_dp_pad_topk_ids_kernel, _dequant_per_token_group_fp8_kernel",
         "why": "the max-len DP padding's top-k mask and the fp8 gather: not the report's configuration (DeepEP "
                "dispatches the routed experts; no fp8 DP gather)"}]}
