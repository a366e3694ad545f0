"""The logits processor on sglang's Ascend path: the ``logits`` component of :mod:`prewarm.providers.sglang.ascend`.

``LogitsProcessor._copy_logits_to_buffer`` (sglang 0.5.23 ``srt/layers/logits_processor.py``) writes the LM head's
logits into the graph's fp32 output buffer (``next_token_logits_buffer``) when the batch has the buffer's shape:
for bf16 / fp16 logits on a device whose tensors say ``is_cuda`` (the NPU, under ``transfer_to_npu``) it calls
``sglang.kernels.ops.activation.softcap.cast_to_float32_logits`` (one Triton kernel: ``softcap_inplace_logits_kernel``
with ``CAST_TO_FP32`` and no softcap; K3 has no ``final_logit_softcapping``). The logits are ``[rows, vocab]``
(decode: one row per request; DSPARK verify: one per draft token), contiguous, so the kernel sees one row of
``rows x vocab`` columns: K3's vocabulary (163840) is a multiple of 16, so every row count gives the same
specialization; one decode and one verify batch per graph bucket stand for all.
"""
from __future__ import annotations

from typing import Callable, Iterator

COMPONENT = "logits"
KERNEL = "sglang.kernels.ops.activation.softcap:softcap_inplace_logits_kernel"


def import_modules() -> None:
    import sglang.kernels.ops.activation.softcap  # noqa: F401


def calls(s, model) -> Iterator[tuple[str, Callable[[], object]]]:
    import torch

    from sglang.kernels.ops.activation.softcap import cast_to_float32_logits

    for bucket in s.graph_buckets or (1,):
        for rows in {bucket, *(bucket * w for w in s.draft_widths)}:
            def cast(rows=rows):
                logits = torch.empty(rows, model.vocab_size, dtype=torch.bfloat16, device="npu")
                buffer = torch.empty(rows, model.vocab_size, dtype=torch.float32, device="npu")
                cast_to_float32_logits(logits, buffer)

            yield f"graph_logits_cast[rows={rows}]", cast


def coverage(s, model) -> dict:
    return {"component": COMPONENT, "planned": [KERNEL], "not_planned": [
        {"what": "sglang.kernels.ops.activation.softcap fused_softcap / gathered softcap",
         "why": "K3 has no final_logit_softcapping"},
        {"what": "the LM head matmul and the logits' TP all-gather", "why": "CANN / HCCL operators, not Triton"}]}
