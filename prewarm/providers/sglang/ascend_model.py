"""Kimi K3 beyond its KDA layers, as sglang's Ascend path shapes it on one rank: ``[spec.sglang.model]``.

The KDA component reads the common KDA tables (:func:`prewarm.providers.sglang.common.read_spec`); every other
component of :mod:`prewarm.providers.sglang.ascend` (the attention-residual bank, the MLPs, the routed experts, the
runner's and allocator's kernels) reads the model's widths and the server's pool geometry from this table, values
as K3's ``config.json`` and sglang's launch line give them:

    [spec.sglang.model]
    hidden_size = 7168                 # config.json hidden_size
    layers = 93                        # num_hidden_layers (the attention-residual bank's block count)
    attn_res_block_size = 12           # config.json attn_res_block_size (the bank holds cdiv(layers, it) rows)
    rms_norm_eps = 1e-5                # the residual bank's score norm epsilon: a constexpr of its mix kernel
    intermediate_size = 33792          # the dense MLP (first_k_dense_replace layers)
    moe_intermediate_size = 3072       # one routed or shared expert
    shared_experts = 2                 # num_shared_experts
    experts = 896                      # num_experts (EP over the whole TP group under DeepEP)
    vocab_size = 163840                # the logits' width (sharded over TP)
    situ_beta = 4.0                    # activation_situ_beta (MoE gemm1_alpha)
    situ_linear_beta = 25.0            # activation_situ_linear_beta (MoE gemm1_clamp_limit)
    page_sizes = [1, 128]              # --page-size (the KV allocator's constexpr page_size)
    context_length = 1048576           # the model's context length (the req_to_token row: a constexpr)

Without the table only the KDA component is planned, and ``prewarm plan`` names the others as not planned.
"""
from __future__ import annotations

from dataclasses import dataclass

from prewarm_kernels.spec import SpecError

TABLE = "model"  # [spec.sglang.model]
INTS = ("hidden_size", "layers", "attn_res_block_size", "intermediate_size", "moe_intermediate_size",
        "shared_experts", "experts", "vocab_size", "context_length")
FLOATS = ("rms_norm_eps", "situ_beta", "situ_linear_beta")


@dataclass(frozen=True)
class K3Model:
    """One rank's view of Kimi K3 under sglang's Ascend path (``[spec.sglang.model]`` and ``[spec.parallel]``)."""

    hidden_size: int
    layers: int
    attn_res_block_size: int
    rms_norm_eps: float
    intermediate_size: int
    moe_intermediate_size: int
    shared_experts: int
    experts: int
    vocab_size: int
    situ_beta: float
    situ_linear_beta: float
    page_sizes: tuple
    context_length: int
    tensor_parallel: int
    attention_dp: int

    @property
    def bank_rows(self) -> int:
        """The attention-residual bank's rows (``AttnBank.open``: ``cdiv(end_layer, attn_res_block_size)``)."""
        return -(self.layers // -self.attn_res_block_size)

    @property
    def local_experts(self) -> int:
        """Routed experts on one rank: DeepEP puts expert parallelism over the whole TP group (ep = tp)."""
        return self.experts // self.tensor_parallel


def read_model(spec: dict) -> K3Model | None:
    """``[spec.sglang.model]`` read and checked (a SpecError naming ``sglang.model.<key>``), or None without it."""
    table = (spec.get("sglang") or {}).get(TABLE) if isinstance(spec.get("sglang"), dict) else None
    if table is None:
        return None
    prefix = f"sglang.{TABLE}"
    if not isinstance(table, dict):
        raise SpecError(prefix, table, "a table (Kimi K3's widths beyond its KDA layers)")
    known = (*INTS, *FLOATS, "page_sizes")
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise SpecError(f"{prefix}.{unknown[0]}", table[unknown[0]], f"no such key (known: {', '.join(known)})")
    values = {}
    for key in INTS:
        v = table.get(key, ...)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise SpecError(f"{prefix}.{key}", v, "a positive integer")
        values[key] = v
    for key in FLOATS:
        v = table.get(key, ...)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise SpecError(f"{prefix}.{key}", v, "a positive number")
        values[key] = float(v)
    pages = table.get("page_sizes", ...)
    if not isinstance(pages, list) or not pages or len(set(pages)) != len(pages) or \
            any(not isinstance(p, int) or isinstance(p, bool) or p <= 0 for p in pages):
        raise SpecError(f"{prefix}.page_sizes", pages, "a non-empty list of distinct positive integers: the "
                        "deployment's --page-size (sglang 0.5.23's default on NPU: 1)")
    parallel = spec.get("parallel") or {}
    tp, dp = parallel.get("tensor_parallel", 1), parallel.get("attention_dp", 1)
    for key, width, whole in (("intermediate_size", values["intermediate_size"], "the dense MLP shards over TP"),
                              ("experts", values["experts"], "DeepEP spreads the routed experts over TP")):
        if width % tp:
            raise SpecError(f"{prefix}.{key}", width, f"a multiple of spec.parallel.tensor_parallel = {tp}: {whole}")
    return K3Model(**values, page_sizes=tuple(sorted(pages)), tensor_parallel=tp, attention_dp=dp)


def req_to_token_width(model: K3Model, page_size: int, draft: int) -> int:
    """The ``req_to_token`` pool's row length (a constexpr of the runner's req_to_token writes): the context length
    plus sglang 0.5.23's headroom (``mem_cache/allocation_sizing.py``, ``get_req_to_token_extra_context_len``):
    ``4 + draft tokens``, and with speculation at a page above 1 at least the decode reserve (2 x the per-step
    allocation, DSPARK's: the draft tokens) + ``page_size - 1``."""
    extra = 4 + draft
    if draft and page_size > 1:
        extra = max(extra, 2 * draft + page_size - 1)
    return model.context_length + extra
