"""Kimi-Linear's MoE as sglang 0.5.23 runs it on CUDA: the model component ``moe`` of ``prewarm.providers.sglang.cuda``.

Kimi-Linear's experts are bf16 (no quantization), so on Hopper sglang's MoE runner backend ``auto`` is the Triton
runner (``srt/layers/moe/moe_runner/triton.py``): per forward, ``_prepare_fused_moe_run`` picks the kernel config with
sglang's own lookup (``try_get_optimal_moe_config``: a tuned file ``E=..,N=..,device_name=..`` for the running Triton,
then any other Triton's, else ``get_default_config``, whose block sizes change with the token count) and aligns the
routed tokens to the block (``moe_align_block_size``: sglang's single-CTA Triton kernel for tiny batches, else
sgl-kernel's CUDA op, which nothing compiles at runtime); ``_fused_moe_kernel_sequence`` then launches the gate/up
``fused_moe_kernel``, the activation (sglang's JIT ``silu_and_mul``), the down ``fused_moe_kernel`` into the per-expert
outputs, and the top-k sum (``moe_sum_reduce_triton`` for at most 32 tokens on a PDL-capable GPU, else sgl-kernel's CUDA
``moe_sum_reduce``). :func:`calls` makes those calls, through sglang's own functions, with the widths of
``[spec.sglang.model]`` and the tensors the runner hands them (``topk_weights`` fp32 and ``topk_ids`` int32 as the
router writes them, the intermediate caches it allocates), at every token count the deployment reaches
(:func:`token_counts`). The config lookup reads the device's name (the target's device profile answers it) and the
running Triton's version (a tuned file for one Triton is not another's): the plan takes what the node's sglang takes.

The router ahead of the experts (:func:`router_route`, :meth:`_Moe.route`): Kimi-Linear's ``KimiMoE`` builds its
``TopK`` with ``use_grouped_topk=True`` and the gate's ``e_score_correction_bias``, so on CUDA ``select_experts`` calls
``biased_grouped_topk_gpu`` (sigmoid scoring whatever config.json's ``moe_router_activation_func``) with the bf16
router logits of the gate (a ``ReplicatedLinear`` in the model's dtype), and with the Triton runner
``apply_routed_scaling_factor_on_output`` is off. For Kimi-Linear's ungrouped top-8 of 256 (``num_expert_group`` =
``topk_group`` = 1) FlashInfer's ``fused_topk_deepseek`` is out (it needs ``topk_group x num_expert_group >= top_k``),
and the route is sglang's Triton ``moe_fused_gate`` on the logits as they are; ``moe_fused_gate`` first asks the
native-CUDA radix router (``moe_route_radix``, an sglang ``load_jit`` module), whose ``covered()`` takes only ``[M,
896]`` top-16 (Kimi K3), then launches ``_router_triton_kernel`` (every width a constexpr, the token count ``M`` an int
Triton specializes: 1, a multiple of 16, other; none at 0 tokens). sglang's own ``moe_fused_gate`` makes the call here,
radix check included. The dispatch in ``biased_grouped_topk_gpu`` itself is not importable without sglang's serving
stack, so :func:`router_route` states its CUDA conditions; the routes it does not plan are named in the coverage.

What the MoE reaches that is not planned here (:data:`NOT_PLANNED`): sgl-kernel's CUDA align and sum (ahead of time:
nothing to compile), the shared expert's and the router's GEMMs (cuBLAS), ``select_experts``' post-processing of the
ids (``torch.compile``, which on this deployment traces no op: :data:`POSTPROCESS`). The activation between the GEMMs
and the shared experts' (sglang's JIT ``silu_and_mul``) is planned by :mod:`.model_mlp`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterator

COMPONENT = "moe"
# the sglang functions whose kernels this component plans ("module:kernel", as a plan names kernels)
KERNELS = ("sglang.kernels.ops.moe.fused_moe_triton_kernels:fused_moe_kernel",
           "sglang.kernels.ops.moe.fused_moe_triton_kernels:_moe_sum_reduce_kernel",
           "sglang.kernels.ops.moe.moe_align_small_numel:_moe_align_small_numel_kernel")
# fused_moe.py's _use_moe_sum_reduce_torch_compile: the Triton sum reduce (on a PDL-capable GPU) up to this many tokens
SUM_REDUCE_TRITON_TOKENS = 32
# invoke_fused_moe_kernel: GDC_EARLY = A.shape[0] <= 512 (A: the tokens in the gate/up GEMM, tokens x top_k in down)
GDC_EARLY_ROWS = 512
# the router's kernel (planned where :func:`router_route` finds sglang's Triton router)
ROUTER_KERNEL = "sglang.kernels.ops.moe.moe_fused_gate:_router_triton_kernel"
NOT_PLANNED = [
    {"what": "sgl_kernel:moe_align_block_size, sgl_kernel:moe_sum_reduce",
     "why": "the align above the Triton kernel's batch limit and the sum above 32 tokens: sgl-kernel's ahead-of-time "
            "CUDA ops, nothing to compile"},
    {"what": "shared expert gate_up_proj / down_proj, router gate, the correction bias's fp32 cast",
     "why": "bf16 GEMMs and an elementwise cast through torch (cuBLAS, ATen): nothing to compile"},
]
# select_experts' post-processing on CUDA, compiled in the serving process
POSTPROCESS = {
    "what": "sglang.srt.layers.moe.topk:_biased_grouped_topk_postprocess (torch.compile, Inductor)",
    "why": "select_experts' id remap and padded-row mask, compiled by Dynamo/Inductor in the serving process: with no "
           "EPLB dispatch (--ep-dispatch-algorithm unset) and no padded-token bound (no expert parallelism, no DP "
           "attention) it returns the router's ids unchanged, so the traced graph holds no op and Inductor generates "
           "no Triton kernel; with EPLB or EP it would generate its kernels in-process, which prewarm does not plan"}


@dataclass(frozen=True)
class MoeSpec:
    """Kimi-Linear's MoE widths per rank (``[spec.sglang.model]``, from config.json)."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # moe_intermediate_size / tensor_parallel: one expert's width on this rank
    routed_scaling_factor: float
    max_tokens: int  # the most tokens one forward hands the MoE (a prefill chunk, or a verify batch)


def read(spec: dict, s) -> MoeSpec | None:
    """The MoE widths of ``[spec.sglang.model]`` (None where the manifest has none: the model is not planned), with
    ``s`` the provider's :class:`~.common.SglangSpec`. A bad value is a SpecError naming ``spec.sglang.model.<key>``."""
    from prewarm_kernels.spec import SpecError

    model = (spec.get("sglang") or {}).get("model")
    if model is None:
        return None
    if not isinstance(model, dict):
        raise SpecError("sglang.model", model, "a table: the model's widths (config.json)")
    ints = {"hidden_size": "config.json hidden_size", "num_experts": "config.json num_experts",
            "experts_per_token": "config.json num_experts_per_token",
            "moe_intermediate_size": "config.json moe_intermediate_size"}
    values = {}
    for key, where in ints.items():
        v = model.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SpecError(f"sglang.model.{key}", v if key in model else ..., f"a positive integer: {where}")
        values[key] = v
    factor = model.get("routed_scaling_factor", 1.0)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise SpecError("sglang.model.routed_scaling_factor", factor, "a positive number: config.json "
                        "routed_scaling_factor (sglang's MoE sum applies it; a constexpr of its Triton sum)")
    tp = s.parallel[0]
    if values["moe_intermediate_size"] % tp:
        raise SpecError("sglang.model.moe_intermediate_size", values["moe_intermediate_size"],
                        f"divisible by the tensor-parallel size ({tp}): each rank holds a slice of every expert")
    return MoeSpec(hidden_size=values["hidden_size"], num_experts=values["num_experts"],
                   top_k=values["experts_per_token"], intermediate_size=values["moe_intermediate_size"] // tp,
                   routed_scaling_factor=float(factor),
                   max_tokens=max(s.max_prefill_tokens if "extend" in s.paths else 0,  # a prefill chunk
                                  s.max_batch * max(s.draft_widths or (1,))))  # a decode or verify batch


@dataclass(frozen=True)
class RouterSpec:
    """Kimi-Linear's router (``[spec.sglang.model]``, from config.json): ``KimiMoE``'s ``TopK`` arguments."""

    num_experts: int
    top_k: int
    num_expert_group: int
    topk_group: int
    renormalize: bool  # config.json moe_renormalize
    routed_scaling_factor: float


# [spec.sglang.model] keys of the router -> where config.json has them
ROUTER_KEYS = {"num_expert_group": "config.json num_expert_group", "topk_group": "config.json topk_group",
               "moe_renormalize": "config.json moe_renormalize"}


def read_router(spec: dict) -> RouterSpec | None:
    """The router's arguments of ``[spec.sglang.model]`` (None where it states none of :data:`ROUTER_KEYS`: the
    router is not planned); one stated without the others, or a bad value, is a SpecError naming the key."""
    from prewarm_kernels.spec import SpecError

    model = (spec.get("sglang") or {}).get("model")
    if not isinstance(model, dict) or not any(key in model for key in ROUTER_KEYS):
        return None
    values = {}
    for key in ("num_expert_group", "topk_group"):
        v = model.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SpecError(f"sglang.model.{key}", v if key in model else ...,
                            f"a positive integer: {ROUTER_KEYS[key]}")
        values[key] = v
    renormalize = model.get("moe_renormalize")
    if not isinstance(renormalize, bool):
        raise SpecError("sglang.model.moe_renormalize", renormalize if "moe_renormalize" in model else ...,
                        "true or false: config.json moe_renormalize (the router renormalizes the top-k weights)")
    experts, groups = model.get("num_experts"), values["num_expert_group"]
    if isinstance(experts, int) and experts % groups:
        raise SpecError("sglang.model.num_expert_group", groups, f"a divisor of num_experts ({experts})")
    if values["topk_group"] > groups:
        raise SpecError("sglang.model.topk_group", values["topk_group"], f"at most num_expert_group ({groups})")
    return RouterSpec(num_experts=experts, top_k=model.get("experts_per_token"), num_expert_group=groups,
                      topk_group=values["topk_group"], renormalize=renormalize,
                      routed_scaling_factor=float(model.get("routed_scaling_factor", 1.0)))


def router_route(r: RouterSpec) -> str | None:
    """None where sglang's CUDA router for ``r`` is its Triton ``moe_fused_gate`` (planned), else why it is not.

    ``biased_grouped_topk_gpu``'s CUDA routes for a static correction bias, no fused shared experts and sglang's
    defaults (no ROCm aiter; ``SGLANG_OPT_USE_JIT_KERNEL_GROUPED_TOPK`` off), in its order: FlashInfer's
    ``fused_topk_deepseek``; the grouped Triton router (logits upcast to fp32); the ungrouped Triton router through
    ``route_quant_handoff`` (384 experts, or more than 512, or top-k above 8: Kimi K2 / K3); the ungrouped Triton router
    on the logits as they are (up to 512 experts, top-k up to 32: Kimi-Linear); else ``biased_grouped_topk_impl``."""
    E, k, G, TG = r.num_experts, r.top_k, r.num_expert_group, r.topk_group
    per_group = E // G
    if (r.renormalize and E & (E - 1) == 0 and k <= 8 and TG * G >= k
            and ((per_group <= 32 and per_group * TG <= 128) if G > 1 else E <= 384)):
        return ("FlashInfer's fused_topk_deepseek (a FlashInfer JIT module built at first use): not planned by "
                "prewarm")
    if G > 1:
        return None
    if E == 384 or (E <= 1024 and (E > 512 or k > 8)):
        return ("the ungrouped Triton router behind route_quant_handoff (and the radix JIT router for [M, 896] "
                "top-16): not yet driven")
    if TG == 1 and E <= 512 and k <= 32:
        return None
    return "biased_grouped_topk_impl (torch.compile: Inductor generates its kernels in-process): not planned"


def token_counts(m: MoeSpec, config_of: Callable[[int], dict], small_numel: int) -> list[int]:
    """The token counts whose launches stand for every count 1..``m.max_tokens``: what the launches take from the
    count is the kernel config (``config_of``: sglang's lookup, asked at every count; each change point and its
    neighbours), the Triton align (``tokens x top_k <= small_numel``: each count, its constexprs follow it), the Triton
    sum (<= 32 tokens), GDC_EARLY (the gate/up GEMM's rows <= 512, the down GEMM's tokens x top_k <= 512), and the
    int classes Triton specializes the sorted-token count, ``tokens x top_k`` and the sum's token count on (1, a
    multiple of 16, other): both parities of every range, and a multiple of 16 in it. ``tests/test_sglang_model.py``
    draws counts from the whole range against the plan."""
    top = m.max_tokens
    edges = {1, top, SUM_REDUCE_TRITON_TOKENS, GDC_EARLY_ROWS, GDC_EARLY_ROWS // m.top_k, small_numel // m.top_k,
             m.num_experts, (m.num_experts + 1) // m.top_k}
    previous = None
    for tokens in range(1, top + 1):  # sglang's own lookup at every count (cached: a dict lookup each)
        config = config_of(tokens)
        if config != previous:
            edges.add(tokens)
            edges.add(tokens - 1)
        previous = config
    out = set(range(1, small_numel // m.top_k + 1))
    for edge in edges:
        out.update(edge + d for d in (-2, -1, 0, 1, 2))
        out.add(max(16, edge // 16 * 16))
    return sorted(t for t in out if 1 <= t <= top)


def calls(spec: dict, s, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) of the router (where :func:`router_route` plans it) and the MoE forward at each of
    :func:`token_counts` (none without ``[spec.sglang.model]``)."""
    m = read(spec, s)
    if m is None:
        return
    router = read_router(spec)
    routed = router is not None and router_route(router) is None
    moe = _Moe(m, device)
    for tokens in token_counts(m, moe.config, moe.small_numel()):
        if routed:  # the router takes the same tokens (its int M: 1, multiples of 16, others all among them)
            yield f"{COMPONENT}/router[T={tokens}]", lambda tokens=tokens: moe.route(router, tokens)
        yield f"{COMPONENT}/fused_experts[T={tokens}]", lambda tokens=tokens: moe.forward(tokens)


class _Moe:
    """One rank's MoE layer as the Triton runner holds it: ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` bf16
    (contiguous, as ``UnquantizedFusedMoEMethod`` creates them), and its forward over ``tokens`` tokens."""

    def __init__(self, m: MoeSpec, device: str):
        self.m, self.device = m, device
        self._weights = None

    def small_numel(self) -> int:
        """The most routed tokens (tokens x top_k) sglang's Triton align takes (above: sgl-kernel's CUDA align); 0
        where the CUDA kernel's own single-block path holds this many experts (it then never runs)."""
        from sglang.kernels.ops.moe.moe_align_small_numel import SMALL_NUMEL_LIMIT

        align = _align_module()
        return SMALL_NUMEL_LIMIT if self.m.num_experts + 1 > align._CUDA_SMALL_BATCH_MAX_BUCKETS else 0

    def config(self, tokens: int) -> dict:
        """sglang's config for a forward of ``tokens`` tokens (``_prepare_fused_moe_run``'s call)."""
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import try_get_optimal_moe_config

        m = self.m
        with published_exec():
            config, _ = try_get_optimal_moe_config((m.num_experts, 2 * m.intermediate_size, m.hidden_size),
                                                   (m.num_experts, m.hidden_size, m.intermediate_size), m.top_k,
                                                   None, tokens, block_shape=None, per_channel_quant=False,
                                                   return_down_config=True)
        return config

    def weights(self):
        import torch

        if self._weights is None:
            m = self.m
            self._weights = (torch.empty(m.num_experts, 2 * m.intermediate_size, m.hidden_size, dtype=torch.bfloat16,
                                         device=self.device),
                             torch.empty(m.num_experts, m.hidden_size, m.intermediate_size, dtype=torch.bfloat16,
                                         device=self.device))
        return self._weights

    def route(self, r: RouterSpec, tokens: int) -> None:
        """``biased_grouped_topk_gpu``'s Triton route over ``tokens`` tokens, as it calls sglang's ``moe_fused_gate``:
        the gate's bf16 logits ``[tokens, E]`` (upcast to fp32 where grouped), the correction bias cast to fp32,
        sigmoid scoring, no fused shared experts, the routed scaling factor left to the MoE sum (the Triton runner)."""
        import torch

        from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate

        logits = torch.empty(tokens, r.num_experts, dtype=torch.bfloat16, device=self.device)
        bias = torch.empty(r.num_experts, dtype=torch.float32, device=self.device)  # correction_bias.to(float32)
        grouped = {"num_expert_group": r.num_expert_group, "topk_group": r.topk_group} \
            if r.num_expert_group > 1 else {}
        moe_fused_gate(logits.to(torch.float32) if grouped else logits, bias, r.top_k, scoring_func="sigmoid",
                       num_fused_shared_experts=0, renormalize=r.renormalize,
                       routed_scaling_factor=r.routed_scaling_factor, apply_routed_scaling_factor_on_output=False,
                       **grouped)

    def forward(self, tokens: int) -> None:
        """``_prepare_fused_moe_run`` then ``_fused_moe_kernel_sequence`` for bf16 without quantization, bias, hooks
        or TMA (no tuned config asks for it), as ``TritonRunnerCore.run`` calls them: the config, the align, the
        gate/up GEMM into ``[tokens x top_k, 2I]``, the down GEMM (routed weights applied) into ``[tokens, top_k,
        H]``, the sum into the output (``routed_scaling_factor``); the activation between the GEMMs is sglang's JIT
        module (:mod:`.model_mlp` plans it)."""
        import torch
        import triton.language as tl

        from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel, moe_sum_reduce_triton
        from sglang.kernels.jit.utils import is_arch_support_pdl

        align = _align_module()
        m, device = self.m, self.device
        w13, w2 = self.weights()
        hidden = torch.empty(tokens, m.hidden_size, dtype=torch.bfloat16, device=device)
        topk_weights = torch.empty(tokens, m.top_k, dtype=torch.float32, device=device)
        topk_ids = torch.empty(tokens, m.top_k, dtype=torch.int32, device=device)
        config = dict(self.config(tokens))
        config.pop("USE_TMA", None)  # _prepare_fused_moe_run: TMA only where a tuned file asks and Triton has it
        with cuda_align_skipped(align):
            sorted_ids, expert_ids, padded = align.moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"],
                                                                        m.num_experts)
        common = dict(compute_type=tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                      use_int4_w4a16=False, per_channel_quant=False, block_shape=None, filter_expert=False)
        cache1 = torch.empty(tokens * m.top_k, 2 * m.intermediate_size, dtype=torch.bfloat16, device=device)
        invoke_fused_moe_kernel(hidden, w13, None, cache1, None, None, None, topk_weights, topk_ids, sorted_ids,
                                expert_ids, padded, False, m.top_k, config, c_sorted=False, b_use_tma=False, **common)
        cache2 = torch.empty(tokens * m.top_k, m.intermediate_size, dtype=torch.bfloat16, device=device)
        cache3 = torch.empty(tokens, m.top_k, m.hidden_size, dtype=torch.bfloat16, device=device)
        invoke_fused_moe_kernel(cache2, w2, None, cache3, None, None, None, topk_weights, topk_ids, sorted_ids,
                                expert_ids, padded, True, 1, config, a_use_tma=False, b_use_tma=False,
                                fuse_sum_all_reduce=False, router_topk=m.top_k, **common)
        if m.top_k > 2 or m.routed_scaling_factor != 1.0:  # moe_combine_topk's reduce (top_k 2 unscaled: torch.add)
            if tokens <= SUM_REDUCE_TRITON_TOKENS and is_arch_support_pdl():
                moe_sum_reduce_triton(cache3, torch.empty_like(hidden), m.routed_scaling_factor)


def _align_module():
    """sglang's ``moe_align_block_size`` module (its package re-exports the function under the module's name)."""
    import importlib

    return importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size")


@contextlib.contextmanager
def published_exec():
    """Within the block the MoE config lookup reads sglang's exec configuration as a server publishes it by default
    (``--enable-deterministic-inference`` off: the tuned or default configs, not the deterministic one); the planner
    publishes no server (``get_exec()`` raises until a server's ``publish``)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as lookup

    published = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
    original, lookup.get_exec = lookup.get_exec, lambda: published
    try:
        yield
    finally:
        lookup.get_exec = original


@contextlib.contextmanager
def cuda_align_skipped(align):
    """Within the block sgl-kernel's CUDA align (``moe_align_block_size``'s batches past its Triton kernel: an
    ahead-of-time op that writes into the buffers sglang allocated) does nothing; sglang's own function still sizes
    the buffers, which the fused MoE kernel takes (their lengths are ints it specializes on)."""
    original = getattr(align, "sgl_moe_align_block_size", None)
    align.sgl_moe_align_block_size = lambda *args, **kwargs: None
    try:
        yield
    finally:
        if original is not None:
            align.sgl_moe_align_block_size = original


def coverage(spec: dict) -> dict:
    """This component's entry of the provider's coverage hook."""
    model = (spec.get("sglang") or {}).get("model")
    if model is None:
        return {"component": COMPONENT, "planned": [], "not_planned": [
            {"what": "the model's MoE", "why": "no [spec.sglang.model] table: the model's widths are not stated"}]}
    router = read_router(spec)
    why = "no num_expert_group / topk_group / moe_renormalize in [spec.sglang.model]: the router's arguments are " \
          "not stated" if router is None else router_route(router)
    routed = [{"what": "the router (biased_grouped_topk_gpu)", "why": why}] if why else []
    return {"component": COMPONENT, "planned": list(KERNELS) + ([] if why else [ROUTER_KERNEL]),
            "not_planned": routed + [dict(d) for d in NOT_PLANNED] + [dict(POSTPROCESS)]}
