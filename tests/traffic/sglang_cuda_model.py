"""Seeded, server-like forwards of Kimi-Linear's MoE layer as sglang 0.5.23 runs it on CUDA (bf16 experts on Hopper:
the Triton MoE runner): the independent model-level traffic ``tests/test_sglang_model.py`` checks the plan of
``prewarm.providers.sglang.cuda`` (its ``moe`` component) against, on fake tensors under the real Triton key
computation.

Written from sglang's own sources, never from the provider:

- How many tokens reach the MoE, per forward mode of the model runner (``model_executor/model_runner.py``,
  ``forward_batch_info.py``, the CUDA graph runners): a prefill chunk (the scheduler's ``PrefillAdder`` packs new and
  continuing requests into at most ``--chunked-prefill-size`` tokens; a long prompt's chunks are full), an eager
  decode batch (1..``--max-running-requests``), an EAGLE target verify (batch x ``--speculative-num-draft-tokens``),
  and the CUDA graph replays of decode and verify, padded to the smallest ``--cuda-graph-bs`` bucket that holds the
  batch (the graph's static buffers: the MoE sees the bucket's tokens).
- The MoE forward (``srt/layers/moe/moe_runner/triton.py`` ``TritonRunnerCore.run`` and
  ``moe_runner/triton_utils/fused_moe.py``): ``_prepare_fused_moe_run`` (``get_config_dtype_str`` of bf16 is None;
  ``try_get_optimal_moe_config`` with w1 ``[E, 2I, H]``, w2 ``[E, H, I]``; ``moe_align_block_size(topk_ids,
  BLOCK_SIZE_M, E)``), ``_fused_moe_kernel_sequence`` (the gate/up ``invoke_fused_moe_kernel`` into
  ``[T * topk, 2I]``, the activation into ``[T * topk, I]``, the down one into ``[T, topk, H]`` with the routed
  weights, ``router_topk``), ``moe_combine_topk`` (top-k > 2: ``moe_sum_reduce_triton`` where
  ``_use_moe_sum_reduce_torch_compile`` (<= 32 tokens) and the GPU supports PDL, else sgl-kernel's CUDA sum), on the
  router's outputs (fp32 weights, int32 ids, ``[T, topk]``).

- The router ahead of the experts (``srt/models/kimi_linear.py`` ``KimiMoE``: the gate, a bf16 ``ReplicatedLinear``,
  then ``TopK(use_grouped_topk=True, num_expert_group, topk_group, correction_bias=e_score_correction_bias,
  renormalize=moe_renormalize, apply_routed_scaling_factor_on_output=should_fuse_routed_scaling_factor_in_topk)``,
  False for the Triton runner's unquantized method), through ``TopK.forward_cuda``, ``select_experts`` and
  ``srt/layers/moe/topk.py`` ``biased_grouped_topk_gpu``: with one group, one kept and top-8, FlashInfer's
  ``fused_topk_deepseek`` is out (groups x kept < top-k) and so is the Kimi K2/K3 branch (256 experts, top-8), which
  leaves the ungrouped ``jit_gate`` call on the logits as the gate wrote them, the bias cast to fp32. Its ids feed the
  experts.

- The logits under the graph runners (``layers/logits_processor.py`` ``_copy_logits_to_buffer``): the lm_head's bf16
  logits cast into the runner's shared fp32 buffer (``cast_to_float32_logits``).

sgl-kernel's CUDA align (batches past the Triton align) is an ahead-of-time op: on fake tensors it is made a no-op
(the buffers sglang sizes still reach the GEMMs; on a GPU it runs); the activation is sglang's JIT module (not a
Triton launch), left out. The expert ids are the router's own (in range on a GPU: its logits and bias are drawn
there), so the same calls run on a GPU.
"""
from __future__ import annotations

import contextlib
import importlib
import random
from types import SimpleNamespace
from typing import Iterator

from prewarm.providers.sglang.common import read_spec
from traffic import Call, cycle, short

SUM_REDUCE_TORCH_COMPILE_TOKENS = 32  # fused_moe.py: _use_moe_sum_reduce_torch_compile
ALIGN = "sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size"
CONFIG = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded MoE forwards within ``spec``'s envelope (``[spec.sglang.model]``: the widths), on ``device``."""
    traffic = _Traffic(spec, random.Random(seed), device)
    for i in range(n):
        yield traffic.draw(i)


def kinds(spec: dict) -> list[str]:
    """The forward modes :func:`calls` draws within ``spec``'s envelope."""
    return _Traffic(spec, random.Random(0), "cpu").kinds


class _Traffic:
    def __init__(self, spec: dict, rng: random.Random, device: str):
        s = read_spec(spec)
        model = spec["sglang"]["model"]
        tp = (spec.get("parallel") or {}).get("tensor_parallel", 1)
        self.rng, self.device = rng, device
        self.E, self.topk, self.H = model["num_experts"], model["experts_per_token"], model["hidden_size"]
        self.I = model["moe_intermediate_size"] // tp
        self.scale = float(model.get("routed_scaling_factor", 1.0))
        # KimiMoE's TopK: Kimi-Linear's router is ungrouped (1 group, 1 kept) and its top-k above 1
        groups, kept = model.get("num_expert_group", 1), model.get("topk_group", 1)
        if (groups, kept) != (1, 1) or self.topk == 1:
            raise ValueError(f"this traffic drives Kimi-Linear's ungrouped router, not {groups} groups x {kept} kept, "
                             f"top-{self.topk}")
        self.renormalize = model.get("moe_renormalize", True)
        self.bias = None
        self.chunk, self.running = s.max_prefill_tokens, s.max_batch
        self.widths, self.buckets = list(s.draft_widths), sorted(s.graph_buckets)
        self.batches = cycle(rng, range(1, self.running + 1))
        self.graph_batches = cycle(rng, range(1, self.buckets[-1] + 1)) if self.buckets else None
        self.kinds = ["prefill", "decode"] + (["graph_decode"] if self.buckets else []) + \
            (["target_verify"] + (["graph_verify"] if self.buckets else []) if self.widths else [])
        self.weights = None
        self.vocab, self.logits_buffer = model.get("vocab_size"), None

    def draw(self, i: int) -> Call:
        kind = self.rng.choice(self.kinds)
        d = {"kind": kind}
        if kind == "prefill":
            if self.rng.random() < 0.2:  # a long prompt's full chunk
                d["lengths"] = [self.chunk]
            else:  # new requests of log-uniform lengths, packed up to the chunk
                lengths, left = [], self.chunk
                for _ in range(self.rng.randint(1, 8)):
                    n = min(left, int(2 ** self.rng.uniform(0, 15)))
                    if n < 1:
                        break
                    lengths.append(n)
                    left -= n
                d["lengths"] = lengths
            d["tokens"] = sum(d["lengths"])
        elif kind in ("decode", "target_verify"):
            d["batch"] = next(self.batches)
            d["width"] = self.rng.choice(self.widths) if kind == "target_verify" else 1
            d["tokens"] = d["batch"] * d["width"]
        else:  # a graph replay: the batch padded to its bucket
            d["batch"] = next(self.graph_batches)
            d["bucket"] = next(b for b in self.buckets if b >= d["batch"])
            d["width"] = self.rng.choice(self.widths) if kind == "graph_verify" else 1
            d["tokens"] = d["bucket"] * d["width"]
        label = f"{kind}#{i}[" + ",".join(f"{k}={short(v)}" for k, v in d.items() if k != "kind") + "]"
        return Call(label, lambda: self.step(d), d)

    def step(self, d: dict) -> None:
        """One forward's MoE, then, under a CUDA graph runner, the logits into the graph's buffer."""
        self.moe(d["tokens"])
        if d["kind"].startswith("graph_") and self.vocab:
            self.logits(d["tokens"])

    def logits(self, T: int) -> None:
        """LogitsProcessor._copy_logits_to_buffer with the graph runner's buffer: the shared fp32 ``[max rows,
        vocab]`` buffer (graph_shared_output.get_logits_buffer) sliced to the batch's tokens, the lm_head's bf16
        logits cast into it (no final_logit_softcapping)."""
        import torch

        from sglang.kernels.ops.activation.softcap import cast_to_float32_logits

        if self.logits_buffer is None:
            rows = self.buckets[-1] * max([1] + self.widths)
            self.logits_buffer = torch.zeros((rows, self.vocab), dtype=torch.float, device=self.device)
        logits = torch.empty(T, self.vocab, dtype=torch.bfloat16, device=self.device)
        cast_to_float32_logits(logits, self.logits_buffer[:T])

    def router(self, T: int):
        """KimiMoE.forward's ``self.gate`` then ``self.topk``: biased_grouped_topk_gpu's ungrouped call,
        ``jit_gate(gating_output, correction_bias.to(torch.float32), topk, scoring_func="sigmoid",
        renormalize=renormalize, routed_scaling_factor=..., apply_routed_scaling_factor_on_output=False)``; the
        bias is the gate's ``nn.Parameter(torch.empty(num_experts))`` in the model's default dtype (bf16)."""
        import torch

        from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate as jit_gate

        if self.bias is None:
            self.bias = torch.randn(self.E, dtype=torch.bfloat16, device=self.device)
        router_logits = torch.randn(T, self.E, dtype=torch.bfloat16, device=self.device)  # the gate's output
        return jit_gate(router_logits, self.bias.to(torch.float32), self.topk, scoring_func="sigmoid",
                        renormalize=self.renormalize, routed_scaling_factor=self.scale,
                        apply_routed_scaling_factor_on_output=False)

    def moe(self, T: int) -> None:
        """TritonRunnerCore.run for bf16 experts: fused_moe.py's prepare, kernel sequence and combine."""
        import torch
        import triton.language as tl

        from sglang.kernels.jit.utils import is_arch_support_pdl
        from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel, moe_sum_reduce_triton

        config_module, align = importlib.import_module(CONFIG), importlib.import_module(ALIGN)
        dev, bf16 = self.device, torch.bfloat16
        if self.weights is None:  # UnquantizedFusedMoEMethod.create_weights: w13 [E, 2I, H], w2 [E, H, I]
            self.weights = (torch.empty(self.E, 2 * self.I, self.H, dtype=bf16, device=dev),
                            torch.empty(self.E, self.H, self.I, dtype=bf16, device=dev))
        w1, w2 = self.weights
        hidden = torch.empty(T, self.H, dtype=bf16, device=dev)
        topk_weights, topk_ids = self.router(T)
        with _server_exec(config_module):
            config, (down_config, _) = config_module.try_get_optimal_moe_config(
                w1.shape, (w2.shape[0], w2.shape[1], w2.shape[2]), topk_ids.shape[1], None, T, block_shape=None,
                per_channel_quant=False, return_down_config=True)
        config = dict(config)
        config.pop("USE_TMA", False)  # no tuned file for these widths: neither GEMM takes TMA
        with _aot_align_off(align) if _is_fake(topk_ids) else _aot_align_in_torch(align):
            sorted_ids, expert_ids, padded = align.moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], w1.shape[0])
        flags = dict(compute_type=tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                     use_int4_w4a16=False, per_channel_quant=False, block_shape=None,
                     filter_expert=False)  # TritonRunnerCore: num_experts == num_local_experts (no EP)
        N = w1.shape[1]
        cache1 = torch.empty((T * self.topk, N), device=dev, dtype=bf16)
        invoke_fused_moe_kernel(hidden, w1, None, cache1, None, None, None, topk_weights, topk_ids, sorted_ids,
                                expert_ids, padded, False, self.topk, config, c_sorted=False, b_use_tma=False,
                                fuse_swiglu=False, **flags)
        cache2 = torch.empty((T * self.topk, N // 2), device=dev, dtype=bf16)
        cache3 = torch.empty((T, self.topk, w2.shape[1]), device=dev, dtype=bf16)
        invoke_fused_moe_kernel(cache2, w2, None, cache3, None, None, None, topk_weights, topk_ids, sorted_ids,
                                expert_ids, padded, True, 1, down_config or config, a_use_tma=False, b_use_tma=False,
                                fuse_sum_all_reduce=False, router_topk=self.topk, **flags)
        out = torch.empty_like(hidden)
        if self.topk == 2 and self.scale == 1.0:
            torch.add(cache3[:, 0], cache3[:, 1], out=out)
        elif T <= SUM_REDUCE_TORCH_COMPILE_TOKENS and is_arch_support_pdl():
            moe_sum_reduce_triton(cache3.view(*cache3.shape), out, self.scale)


@contextlib.contextmanager
def _aot_align_in_torch(align):
    """On a GPU whose image lacks sgl-kernel (built for the server's torch), its CUDA align's contents in torch
    (``traffic.fill_expert_alignment``); with sgl-kernel present, sgl-kernel's own."""
    import importlib.util

    if importlib.util.find_spec("sgl_kernel") is not None:
        yield
        return
    from traffic import fill_expert_alignment

    saved = getattr(align, "sgl_moe_align_block_size", None)
    # sglang passes num_experts + 1 buckets (the last for EP's filtered -1 ids, which no call here draws)
    align.sgl_moe_align_block_size = lambda ids, buckets, block, sorted_ids, expert_ids, post_pad, *a, **k: \
        fill_expert_alignment(ids, block, buckets - 1, sorted_ids, expert_ids, post_pad)
    try:
        yield
    finally:
        if saved is not None:
            align.sgl_moe_align_block_size = saved


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def _server_exec(config_module):
    """The exec configuration a server publishes by default (deterministic inference off) for the config lookup."""
    bag = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
    saved, config_module.get_exec = config_module.get_exec, lambda: bag
    try:
        yield
    finally:
        config_module.get_exec = saved


@contextlib.contextmanager
def _aot_align_off(align):
    """sgl-kernel's ahead-of-time CUDA align as a no-op (it fills buffers sglang already sized)."""
    saved = getattr(align, "sgl_moe_align_block_size", None)
    align.sgl_moe_align_block_size = lambda *a, **k: None
    try:
        yield
    finally:
        if saved is not None:
            align.sgl_moe_align_block_size = saved
