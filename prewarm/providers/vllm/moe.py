"""Kimi-Linear's MoE layers as vLLM 0.34.0 runs them on a Hopper GPU in bf16: the component ``moe`` of
``prewarm.providers.vllm.kda``.

vLLM's unquantized-MoE oracle (``fused_moe/oracle/unquantized.py``) puts the FlashInfer backends last on the SM90
family, so a bf16 ``KimiMoE`` (``vllm/models/kimi_k3/nvidia/model.py``: 256 routed experts, top-8, one shared expert
that runs as its own MLP, not fused into the routed ones off ROCm) runs ``TritonExperts.apply``
(``fused_moe/experts/triton_moe.py``). Per step of M tokens that is, planned here with vLLM's own functions:

- the config: ``try_get_optimal_moe_config(w1.size(), w2.size(), top_k, config_name(dtype), M)``, vLLM's lookup of a
  tuned file ``E=<experts>,N=<intermediate per rank>,device_name=<the target's>.json`` (none ships for Kimi-Linear's
  E=256,N=1024 on an H200: the defaults, which change with M) over every token count 1..the step budget; the counts
  planned are each config range's ends and the next ones (``naive`` block assignment, parity: Triton specializes
  ``EM`` and ``num_valid_tokens`` on divisibility by 16) plus :func:`prewarm.providers.capture.batch_sizes`;
- the block assignment: ``_prepare_expert_assignment`` (``sorted_token_ids`` None below ``M x top_k x 4 <= E``: a
  pointer the kernel specializes on, otherwise ``moe_align_block_size``'s buffers, whose CUDA op only fills what its
  Python wrapper allocated: on fake tensors it is skipped);
- the two GEMMs: ``invoke_fused_moe_triton_kernel`` for w13 (hidden states [M, K] -> [M, top_k, N]) and w2 (the
  activation's [M x top_k, N/2] -> [M, top_k, K], router weights applied), the workspaces as ``_resize_cache`` views.

Not Triton (compiled into the wheel, nothing to prewarm): the router's ``grouped_topk``, ``moe_align_block_size``,
the activation ``silu_and_mul`` and ``moe_sum``, the shared expert's and dense MLP's matmuls.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

from prewarm_kernels.spec import SpecError

from ..capture import batch_sizes

FUSED_MOE = "vllm.model_executor.layers.fused_moe.fused_moe"
ALIGN = "vllm.model_executor.layers.fused_moe.moe_align_block_size"
KEYS = ("moe_experts", "moe_top_k", "moe_hidden_size", "moe_intermediate_size")  # [spec.vllm]: the MoE's widths
TOPK_IDS_DTYPE = "int32"  # the router's ids: grouped_topk's fused CUDA op outputs int32 (read by the naive path)
MIN_INTERMEDIATE_PER_PARTITION = 256  # KimiMoE pads the per-rank intermediate size up to this (its config default)
PLANNED = [f"{FUSED_MOE}:fused_moe_kernel"]
NOT_PLANNED = [
    {"what": "vllm._moe_C:moe_align_block_size, vllm._C:moe_sum, silu_and_mul, grouped_topk",
     "why": "CUDA C ops compiled into the vLLM wheel: no Triton compile, nothing a cache holds"},
    {"what": f"{FUSED_MOE}:fused_moe_kernel (fp8 / int8 / int4 / TMA / tensor-descriptor variants)",
     "why": "quantized or non-Hopper paths: Kimi-Linear's MoE is bf16 on SM90"},
    {"what": f"{FUSED_MOE}:fused_moe_kernel with int64 expert ids (the naive block assignment, up to 8 tokens)",
     "why": "Kimi-Linear's router (grouped_topk's fused op) hands int32 ids; EPLB or another router is not planned"},
    {"what": "a tuned E=256,N=1024 config file (VLLM_TUNED_CONFIG_FOLDER or a later wheel's configs/)",
     "why": "the plan takes vLLM's lookup in the build's vLLM: a node reading another file picks other tiles"},
]


@dataclass(frozen=True)
class MoeSpec:
    """Kimi-Linear's MoE on one rank: routed experts, top-k, hidden size, the intermediate size of the model."""

    experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    tensor_parallel: int
    dtype: str
    max_tokens: int

    @property
    def intermediate_per_rank(self) -> int:
        """``KimiMoE``'s padded per-partition intermediate size."""
        return max(self.intermediate_size // self.tensor_parallel, MIN_INTERMEDIATE_PER_PARTITION)


def read_spec(table: dict, tensor_parallel: int, dtype: str, max_tokens: int) -> MoeSpec | None:
    """``[spec.vllm]`` ``moe_experts``, ``moe_top_k``, ``moe_hidden_size``, ``moe_intermediate_size`` (config.json:
    num_experts, num_experts_per_token, hidden_size, moe_intermediate_size); None where none is given (no MoE
    planned)."""
    given = [k for k in KEYS if k in table]
    if not given:
        return None
    for key in KEYS:
        value = table.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"vllm.{key}", value if key in table else ..., "a positive integer: the MoE's "
                            f"{', '.join(KEYS)} are given together (config.json: num_experts, num_experts_per_token, "
                            "hidden_size, moe_intermediate_size)")
    if table["moe_top_k"] > table["moe_experts"]:
        raise SpecError("vllm.moe_top_k", table["moe_top_k"], f"at most moe_experts ({table['moe_experts']})")
    if table["moe_intermediate_size"] % tensor_parallel:
        raise SpecError("vllm.moe_intermediate_size", table["moe_intermediate_size"],
                        f"divisible by the tensor-parallel width ({tensor_parallel})")
    return MoeSpec(experts=table["moe_experts"], top_k=table["moe_top_k"], hidden_size=table["moe_hidden_size"],
                   intermediate_size=table["moe_intermediate_size"], tensor_parallel=tensor_parallel, dtype=dtype,
                   max_tokens=max_tokens)


def token_counts(m: MoeSpec, config_of: Callable[[int], dict]) -> list[int]:
    """The token counts whose launches stand for 1..``m.max_tokens``: each range of counts vLLM's lookup gives one
    config, its two ends and the counts beside them, plus ``batch_sizes``."""
    counts, start, last = set(batch_sizes(m.max_tokens)), 1, None
    for M in range(1, m.max_tokens + 2):
        config = config_of(M) if M <= m.max_tokens else None
        if last is not None and config != last:
            counts |= {start, start + 1, M - 2, M - 1}
            start = M
        last = config
    return sorted(c for c in counts if 1 <= c <= m.max_tokens)


def calls(m: MoeSpec, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call) per token count: one ``TritonExperts.apply``'s Triton launches each."""
    import importlib

    import torch

    fm = importlib.import_module(FUSED_MOE)
    config_mod = importlib.import_module("vllm.model_executor.layers.fused_moe.config")
    utils = importlib.import_module("vllm.model_executor.layers.fused_moe.utils")
    dtype = getattr(torch, m.dtype)
    compute_type = {torch.bfloat16: fm.tl.bfloat16, torch.float16: fm.tl.float16, torch.float32: fm.tl.float32}[dtype]
    E, K, top_k = m.experts, m.hidden_size, m.top_k
    N = 2 * m.intermediate_per_rank  # w13: gate and up
    made = {}

    def weights():
        if "w" not in made:
            made["w"] = (torch.zeros(E, N, K, dtype=dtype, device=device),
                         torch.zeros(E, K, N // 2, dtype=dtype, device=device))
        return made["w"]

    config_name = config_mod.FUSED_MOE_UNQUANTIZED_CONFIG.config_name(dtype)

    def config_of(M: int) -> dict:
        return fm.try_get_optimal_moe_config((E, N, K), (E, K, N // 2), top_k, config_name, M)

    for M in token_counts(m, config_of):
        def call(M=M):
            w1, w2 = weights()
            config = fm.try_get_optimal_moe_config(w1.size(), w2.size(), top_k, config_name, M)
            hidden = torch.zeros(M, K, dtype=dtype, device=device)
            topk_ids = torch.zeros(M, top_k, dtype=getattr(torch, TOPK_IDS_DTYPE), device=device)
            topk_weights = torch.zeros(M, top_k, dtype=torch.float32, device=device)
            # TritonExperts.workspace_shapes: (M, top_k, max(N/2, K)) and (M, top_k, max(N, K))
            workspace13 = torch.empty(M, top_k, max(N // 2, K), dtype=dtype, device=device)
            workspace2 = torch.empty(M, top_k, max(N, K), dtype=dtype, device=device)
            cache1 = utils._resize_cache(workspace2, (M, top_k, N))
            cache2 = utils._resize_cache(workspace13, (M * top_k, N // 2))
            cache3 = utils._resize_cache(workspace2, (M, top_k, K))
            with _align_outputs_only(topk_ids):
                sorted_ids, expert_ids, post_padded = fm._prepare_expert_assignment(
                    topk_ids, config, M, top_k, E, None)
            for a, b, c, weighted, k, weights_ in ((hidden, w1, cache1, False, top_k, None),
                                                   (cache2, w2, cache3, True, 1, topk_weights)):
                fm.invoke_fused_moe_triton_kernel(
                    a, b, c, None, None, weights_, sorted_ids, expert_ids, post_padded, weighted, k, config,
                    compute_type=compute_type, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                    use_int4_w4a16=False, per_channel_quant=False, block_shape=None, B_bias=None)

        yield f"moe[E={E},top_k={top_k},N={N},K={K},M={M}]", call


@contextlib.contextmanager
def _align_outputs_only(topk_ids) -> Iterator[None]:
    """``moe_align_block_size``'s compiled CUDA op fills the three buffers its Python wrapper allocates; on fake
    tensors nothing is filled, so the op is skipped and the wrapper's buffers (their shapes and dtypes) kept. On a
    device (``run``) the op runs."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(topk_ids, FakeTensor):
        yield
        return
    align = importlib.import_module(ALIGN)

    class Ops:
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def moe_align_block_size(*args, **kwargs):
            return None

    ops = align.ops
    align.ops = Ops()
    try:
        yield
    finally:
        align.ops = ops
