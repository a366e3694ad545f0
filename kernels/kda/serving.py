"""The serving mix of one KDA layer, as launches to plan (``launches``) or to run for real (``run``).

Both go through the same call builder, so the launches recorded on ``meta`` tensors are exactly the ones a real
run makes. For every declared (activation dtype, gate dtype) pair: prefill is one packed varlen ``chunk_kda_fwd``
(initial states from a pool by index, final state out), decode one recurrent call, verify one recurrent call per
draft width > 1, decode and verify once with beta in the activation dtype and once in fp32 (the recurrent kernel
reads either as given: ``common.as_read``); the fused gate and the in-kernel q/k L2 norm as the spec declares.
Nothing else varies a compiled variant: the wrappers canonicalize every other argument (see ``common``), and batch
sizes, sequence counts and lengths are never specialized, so one call of each kind stands for all of them. ``run``
makes the same calls on a device, so a device build (and ``prewarm tune``) autotunes every planned autotune key
(Triton's key includes the argument dtypes). The prefill kernels' keys also carry the batch's token bucket
(``common.TOKEN_BUCKETS``): where configs are autotuned, prefill is planned once per bucket up to
``[spec.serving] max_prefill_tokens`` (every bucket without one), at the bucket's size.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..backend import REGISTRY, select, use
from ..launch import Launch, capture
from ..spec import SpecError, fla_only_key, read_kda
from .chunk import chunk_kda_fwd
from .common import TOKEN_BUCKETS, token_buckets
from .recurrent import recurrent_kda

# A packed prefill: lengths 1, 63, 64, 65 (the chunk boundary cases), the rest of its tokens in sequences of at most
# PREFILL_SEQ_LEN, as a server batches several requests. Lengths are runtime values (read from cu_seqlens in-kernel):
# they change no compiled variant, only the token bucket of the tuning key (and, on a device, what is timed).
PREFILL_HEAD = (1, 63, 64, 65)
PREFILL_SEQ_LEN = 4096
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_pairs(spec: dict) -> list[tuple[str, str]]:
    """Every (activation, gate) dtype pair to plan: the cross product of a read spec's ``dtypes``."""
    return [(a, g) for a in spec["dtypes"]["activation"] for g in spec["dtypes"]["gate"]]


def prefill_lengths(tokens: int) -> list[int]:
    """The sequence lengths of the planned prefill of ``tokens`` tokens (at least the boundary cases' 193)."""
    rest = max(tokens - sum(PREFILL_HEAD), 1)
    n = -(-rest // PREFILL_SEQ_LEN)
    return [*PREFILL_HEAD, *(rest // n + (i < rest % n) for i in range(n))]


def prefill_buckets(spec: dict) -> list[int]:
    """The token buckets prefill is planned at: every one up to the token budget where the prefill kernels are
    autotuned, one where their configs are pinned (the bucket then changes nothing)."""
    if not select("cumsum", spec["backend"]).autotuned:
        return [TOKEN_BUCKETS[0]]
    return token_buckets(spec["max_prefill_tokens"])


def _check(spec: dict) -> dict:
    """The manifest's spec read (``prewarm_kernels.spec``), and what these kernels support on top of it."""
    read = read_kda(spec)
    if read["backend"] is None:
        raise SpecError("backend", ..., "the target's backend (cuda or npu)")
    if fla_only_key(spec):  # these wrappers canonicalize what fla-core's calls vary: the key would change nothing
        raise SpecError(*fla_only_key(spec), "absent: an option of fla-core's KDA (prewarm.providers.fla.kda)")
    if read["head_k_dim"] > 256:
        raise SpecError("model.head_k_dim", read["head_k_dim"], "at most 256 (the kernels' head dim limit)")
    return read


def _calls(spec: dict, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label prefix, thunk) for every call of the serving mix, tensors built on ``device`` (meta: shapes only)."""
    H, K, V = spec["heads"], spec["head_k_dim"], spec["head_v_dim"]
    lb = spec.get("gate_lower_bound")
    fused, l2norm = spec.get("fused_gate", True), spec.get("qk_l2norm", True)
    buckets = sorted(set(spec["decode_batch_buckets"]))
    drafts = sorted(set(d for d in spec["draft_widths"] if d > 1))
    t_buckets = prefill_buckets(spec) if spec["prefill"] else []
    pool_size = max(buckets + [len(prefill_lengths(t)) for t in t_buckets])
    # values made on the device itself (a 65536-token prefill's inputs are GBs); on meta only shapes matter
    gen = None if torch.device(device).type == "meta" else torch.Generator(device=device).manual_seed(0)

    def random(*shape, dtype, normal=True, scale=1.0):
        if gen is None:
            return torch.empty(*shape, dtype=dtype, device=device)
        x = torch.randn(*shape, generator=gen, device=device) if normal else \
            torch.rand(*shape, generator=gen, device=device)
        return (x * scale).to(dtype)

    gate = {"A_log": random(H, dtype=torch.float32, scale=0.5),
            "dt_bias": random(H * K, dtype=torch.float32, scale=0.5),
            "lower_bound": None if lb is None else float(lb)} if fused else {}
    pool = torch.zeros(pool_size, H, K, V, dtype=torch.float32, device=device)
    pairs = dtype_pairs(spec)

    def layer_inputs(T: int, act: torch.dtype, gdt: torch.dtype):
        """q, k, v, g, beta: beta in the activation dtype, as many models produce it (chunk_kda_fwd makes it fp32)."""
        g = random(1, T, H, K, dtype=gdt) if fused else random(1, T, H, K, dtype=gdt, normal=False, scale=-1.0)
        beta = random(1, T, H, dtype=act, normal=False)
        return (random(1, T, H, K, dtype=act), random(1, T, H, K, dtype=act), random(1, T, H, V, dtype=act), g,
                beta)

    for act_name, gate_name in pairs:
        act, gdt = _DTYPES[act_name], _DTYPES[gate_name]
        tag = "" if len(pairs) == 1 else f"act={act_name},gate={gate_name}"

        def label(kind: str, *extra: str) -> str:
            inside = ",".join([*extra, tag] if tag else extra)
            return f"{kind}[{inside}]" if inside else kind

        for tokens in t_buckets:
            def prefill(act=act, gdt=gdt, lengths=prefill_lengths(tokens)):
                cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)  # small index tensor: real, on the CPU
                q, k, v, g, beta = layer_inputs(sum(lengths), act, gdt)
                idx = torch.arange(len(lengths), dtype=torch.int32).to(device)
                return chunk_kda_fwd(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
                                     output_final_state=True, cu_seqlens=cu, use_qk_l2norm=l2norm, **gate)
            yield label("prefill", f"tokens={tokens}"), prefill
        if not buckets:
            continue

        def recurrent(draft: int, beta_dtype: torch.dtype | None, act=act, gdt=gdt):
            def call():
                bs = buckets[-1]  # any batch size compiles the same variant: N is a runtime int, never specialized
                q, k, v, g, beta = layer_inputs(bs * draft, act, gdt)
                idx = torch.arange(bs, dtype=torch.int32).to(device)
                beta = beta if beta_dtype is None else beta.to(beta_dtype)
                return recurrent_kda(q, k, v, g, beta, pool, idx, draft_width=draft, use_qk_l2norm=l2norm, **gate)
            return call

        # the recurrent kernel reads beta as given in the activation dtype or fp32 (common.as_read): one variant each
        for beta_dtype in [None] + [torch.float32] * (act != torch.float32):
            extra = [] if beta_dtype is None else ["beta=float32"]
            yield label("decode", *extra), recurrent(1, beta_dtype)
            for d in drafts:
                yield label("verify", f"draft={d}", *extra), recurrent(d, beta_dtype)


def _kernel_name(kernel) -> str:
    for name, entry in REGISTRY.items():
        if kernel is entry.kernel or kernel is getattr(entry.kernel, "fn", None):
            return name
    return getattr(kernel, "__name__", type(kernel).__name__)


def launches(spec: dict) -> list[Launch]:
    """Every kernel launch of the serving mix on ``spec["backend"]``, captured on meta tensors (nothing runs)."""
    spec = _check(spec)
    out: list[Launch] = []
    with use(spec["backend"]):
        for prefix, call in _calls(spec, "meta"):
            with capture() as records:
                call()
            for rec in records:
                rec.label = f"{prefix}/{_kernel_name(rec.kernel)}"
            out.extend(records)
    return out


def run(spec: dict, device: str = "cuda") -> None:
    """Run the same calls on random tensors on ``device`` (compiles, and autotunes where autotuned)."""
    spec = _check(spec)
    with use(spec["backend"]):
        for _, call in _calls(spec, device):
            call()
