"""Kimi K3's routed experts on sglang's Ascend path: the ``moe`` component of :mod:`prewarm.providers.sglang.ascend`.

The report's launch line serves K3's W4A8 int MoE checkpoint (ModelSlim) with ``--moe-a2a-backend deepep``: the
Ascend MoE runner (``srt/layers/moe/moe_runner/ascend.py``, ``AscendMoeRunner.__init__``) takes its DeepEP branch,
where ``activation == "situ"`` makes its activation ``NPUSitu(need_quant=<the W4A8/W8A8 int kernel>, beta=
gemm1_alpha (activation_situ_beta), linear_beta=gemm1_clamp_limit (activation_situ_linear_beta))``, and ``run``
calls ``_apply_activation(w13 output, group_list=expert_tokens, group_list_type=1)`` between the two grouped
matmuls: sgl-kernel-npu's ``situ`` with the int8 requant, one kernel (``_situ_kernel``) whose constexprs are the
expert width, the local expert count (and its alignment), the betas and ``NEED_QUANT``. DeepEP's normal (prefill) and
low-latency (decode) dispatches both hand the runner the per-expert counts in int64 (``pre_permute_deepep_normal_
to_ascend``: ``torch.tensor(..., dtype=torch.int64)``; ``pre_permute_deepep_ll_to_ascend``: ``.to(torch.int64)``).

:func:`calls` builds sglang's own ``NPUSitu`` (the wheel's ``hardware_backend/npu/moe/activation.py``) and calls it as
the runner does; the w13 output is ``[received rows, 2 x moe_intermediate_size]`` in bf16 (``original_dtype``), the
group list one count per local expert (``num_experts / ep``, ep = tp under DeepEP). The rows a rank receives are a
shape, not a specialization: one count stands for all. With ``need_quant`` false (a BF16 or MXFP4 checkpoint, the
non-DeepEP branch) the same kernel is another variant: planned too, so a rollout of another checkpoint is covered.
"""
from __future__ import annotations

from typing import Callable, Iterator

COMPONENT = "moe"
KERNEL = "sgl_kernel_npu.activation.situ:_situ_kernel"
ROWS = 48  # rows a rank receives from the dispatch: a shape only


def import_modules() -> None:
    import sgl_kernel_npu.activation.situ  # noqa: F401
    import sglang.srt.hardware_backend.npu.moe.activation  # noqa: F401


def calls(s, model) -> Iterator[tuple[str, Callable[[], object]]]:
    import torch

    from sglang.srt.hardware_backend.npu.moe.activation import NPUSitu

    width, experts = model.moe_intermediate_size, model.local_experts
    for need_quant in (True, False):  # W4A8 / W8A8 int (the report's checkpoint), then BF16 / MXFP4 experts
        def call(need_quant=need_quant):
            activation = NPUSitu(need_quant=need_quant, beta=model.situ_beta, linear_beta=model.situ_linear_beta)
            w13_out = torch.empty(ROWS, 2 * width, dtype=torch.bfloat16, device="npu")
            expert_tokens = torch.empty(experts, dtype=torch.int64, device="npu")
            activation._apply_activation(w13_out, group_list=expert_tokens, group_list_type=1)

        yield f"routed_situ[width={width},experts={experts},quant={need_quant}]", call


def coverage(s, model) -> dict:
    return {"component": COMPONENT, "planned": [KERNEL], "not_planned": [
        {"what": "sgl_kernel_npu.activation.situ_mxfp8_quant (SGLANG_NPU_MOE_SITU_MXFP8_FUSED, MXFP4 W4A8)",
         "why": "another checkpoint's path (the report serves W4A8 int); that module is not in the vendored "
                "sgl-kernel-npu snapshot either"},
        {"what": "DeepEP dispatch/combine, the grouped matmuls, the router's top-k",
         "why": "CANN / torch_npu operators (npu_grouped_matmul, npu_moe_distribute_*), not Triton"}]}
