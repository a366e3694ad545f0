"""Kimi K3's SiTU MLPs on sglang's Ascend path: the ``mlp`` component of :mod:`prewarm.providers.sglang.ascend`.

``KimiK3MLP`` (sglang 0.5.23 ``srt/models/kimi_k3.py``) is the dense layers' MLP (``first_k_dense_replace``) and the
MoE layers' shared experts (``moe_intermediate_size x num_shared_experts`` wide); with ``hidden_act = "situ"`` its
activation is ``SituAndMul``, whose ``forward_npu`` (``srt/layers/activation.py``) calls sgl-kernel-npu's
``situ_and_mul(x)`` on the ``[rows, 2 x width]`` gate/up projection output, with that function's default betas
(4.0 / 25.0: it passes no others). That kernel, ``_situ_and_mul_kernel``, is ``@triton.autotune`` over 4 configs
keyed on ``HALF_COLS`` and ``HAS_GROUP_LIST``: the manifest's autotune table pins it, or every node benchmarks it at
its first request.

The widths per rank follow the report's launch line (no ``--enable-dense-mlp-attn-tp``, no
``--shared-experts-tp-size``; ``kimi_k3.py``: ``_dense_mlp_parallel_group`` and ``KimiK3MoE.__init__``): the dense
MLP shards over the whole TP group (``intermediate_size / tp``); under DeepEP the shared experts are replicated
(``shared_experts_parallel_group = "replicated"``: the whole ``moe_intermediate_size x num_shared_experts``). sglang's
module is not imported here (``activation.py`` imports the serving stack); the one call it makes is made with its
arguments. Rows: the batch's tokens (under DP attention the dense MLP reads the DP-gathered rows): ``N_ROWS`` is a
specialized int, so one row count of each class (1, a multiple of 16, other) stands for all.
"""
from __future__ import annotations

from typing import Callable, Iterator

COMPONENT = "mlp"
KERNEL = "sgl_kernel_npu.activation.situ:_situ_and_mul_kernel"
ROWS = (1, 16, 3)  # one row count per specialization class of N_ROWS


def import_modules() -> None:
    import sgl_kernel_npu.activation.situ  # noqa: F401


def widths(model) -> dict[str, int]:
    """Each SituAndMul of the model -> its output width per rank (HALF_COLS)."""
    return {"dense": model.intermediate_size // model.tensor_parallel,
            "shared_experts": model.moe_intermediate_size * model.shared_experts}


def calls(s, model) -> Iterator[tuple[str, Callable[[], object]]]:
    import torch

    from sgl_kernel_npu.activation.situ import situ_and_mul

    for name, width in widths(model).items():
        for rows in ROWS:
            def call(width=width, rows=rows):
                gate_up = torch.empty(rows, 2 * width, dtype=torch.bfloat16, device="npu")
                situ_and_mul(gate_up)  # SituAndMul.forward_npu

            yield f"{name}[width={width},rows={rows}]", call


def coverage(s, model) -> dict:
    return {"component": COMPONENT, "planned": [KERNEL], "not_planned": [
        {"what": "the MLPs' gate_up / down projections and RMSNorms",
         "why": "torch_npu / CANN operators (npu_rms_norm, matmuls), not Triton"}]}
