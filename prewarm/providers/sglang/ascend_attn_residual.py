"""Kimi K3's attention-residual bank on sglang's Ascend path: the ``attn_residual`` component of
:mod:`prewarm.providers.sglang.ascend`.

With ``attn_res_block_size`` set, every K3 decoder layer reads its attention and FFN inputs through the bank
(``srt/layers/layer_boundary/residual/attn_bank.py``: ``AttnBankState`` -> ``AttnResidual.forward``), and the stack's
output and DSPARK's aux capture through ``aggregate_stream``; on NPU each aggregation with banked rows is
sgl-kernel-npu's ``kimi_k3/attn_residual.py`` ``mix_fused`` (``srt/layers/attn_residual.py`` ``_mix_fused``:
``is_npu()``), one persistent kernel whose constexprs are the hidden size, the score norm's epsilon, the vector-core
count and ``NB = next_power_of_2(valid rows + 1)``; the token count and the row count are ``do_not_specialize``.

:func:`calls` drives sglang's own ``AttnResidual`` (the wheel's module; its ``RMSNorm`` and ``ReplicatedLinear`` are
stood in: on NPU both are CANN operators) as a forward pass does: the bank opened over ``cdiv(layers,
attn_res_block_size)`` rows (``AttnBank.open``), layer 0's read of an empty bank (its norm alone) and snapshot, then,
for every number of valid rows a layer can meet (1 up to the bank's rows: the output read aggregates them all), a
read without a pending add (a block-write layer's attention input, a stack entry) and one with it (a layer's FFN
input), with the bank's write of the next row; and
``aggregate_stream`` (the final stream value DSPARK captures). One token count per mode stands for all (none
reaches a specialization): decode's 1, a prefill's several.
"""
from __future__ import annotations

from typing import Callable, Iterator

COMPONENT = "attn_residual"
KERNEL = "sgl_kernel_npu.kimi_k3.attn_residual:_mix_fused_kernel"
TOKENS = (1, 37)  # a decode batch's row and a prefill's rows: N is do_not_specialize


def import_modules() -> None:
    import sgl_kernel_npu.kimi_k3.attn_residual  # noqa: F401
    import sglang.srt.layers.attn_residual  # noqa: F401


def calls(s, model) -> Iterator[tuple[str, Callable[[], object]]]:
    import torch

    from sglang.srt.layers.attn_residual import AttnResidual, aggregate_stream
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.linear import ReplicatedLinear

    hidden, rows = model.hidden_size, model.bank_rows

    def params():
        # a layer's score projection / norm and its input norm, in the model's dtype (get_cw reads them in fp32)
        return (ReplicatedLinear(hidden, 1, bias=False, params_dtype=torch.bfloat16),
                RMSNorm(hidden, eps=model.rms_norm_eps, weight_dtype=torch.bfloat16),
                RMSNorm(hidden, eps=model.rms_norm_eps, weight_dtype=torch.bfloat16))

    for tokens in TOKENS:
        def reads(tokens=tokens):
            proj, score_norm, out_norm = params()
            hidden_states = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="npu")
            bank = AttnResidual(hidden_states, rows)  # AttnBank.open
            bank.forward(hidden_states, None, proj, score_norm, out_norm, write=True)  # layer 0: nothing banked
            for valid in range(1, rows + 1):
                contribution = torch.empty_like(hidden_states)
                # a read with no pending add (a block-write layer's attention input, a stack entry)
                bank.forward(contribution, None, proj, score_norm, out_norm)
                # the FFN read: the attention output's add folded into the aggregation; a block-write layer's
                # snapshot of the next row after it
                bank.forward(contribution, hidden_states, proj, score_norm, out_norm, write=valid < rows)
            # the stack's output value DSPARK's aux capture reads (KimiK3Model: aggregate_stream over every row)
            aggregate_stream(hidden_states, bank.block_residual, bank.num_valid_blocks, proj, score_norm)

        yield f"bank[hidden={hidden},rows={rows},tokens={tokens}]", reads


def coverage(s, model) -> dict:
    return {"component": COMPONENT, "planned": [KERNEL], "not_planned": [
        {"what": "sglang.srt.layers.attn_residual:_score_kernel, _combine_kernel",
         "why": "the CUDA/ROCm pipeline of the same mix: on NPU _mix_fused returns sgl-kernel-npu's mix_fused first"},
        {"what": "the bank's score / output RMSNorms",
         "why": "torch_npu.npu_rms_norm (CANN), not Triton"}]}
