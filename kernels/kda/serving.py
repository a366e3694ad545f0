"""The serving mix of one KDA layer, as launches to plan (``launches``) or to run for real (``run``).

Both go through the same call builder, so the launches recorded on ``meta`` tensors are exactly the ones a real
run makes: prefill is one packed varlen ``chunk_kda_fwd`` (fused gate, in-kernel q/k L2 norm, initial states from
a pool by index, final state out); decode is one recurrent call per batch bucket (1 token per sequence); verify is
one recurrent call per (decode bucket, draft width): the token bucket next_pow2(bs * draft) is a constexpr of the
recurrent kernel, so every pair is its own compiled variant and all of them are planned.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..backend import REGISTRY, use
from ..launch import Launch, capture
from .chunk import chunk_kda_fwd
from .recurrent import recurrent_kda

# Representative packed prefill: lengths 1, 63, 64, 65 and a longer one. Lengths are runtime values (T is not
# specialized), so they do not change what compiles; they only have to be valid.
PREFILL_CU_SEQLENS = (0, 1, 64, 128, 193, 449)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_REQUIRED = ("backend", "heads", "head_k_dim", "head_v_dim", "dtype", "prefill", "decode_batch_buckets",
             "draft_widths")


def _check(spec: dict) -> None:
    missing = [k for k in _REQUIRED if k not in spec]
    if missing:
        raise ValueError(f"serving spec is missing {missing}")
    if spec["dtype"] not in _DTYPES:
        raise ValueError(f"serving spec dtype {spec['dtype']!r}: expected one of {sorted(_DTYPES)}")
    for key in ("heads", "head_k_dim", "head_v_dim"):
        if not isinstance(spec[key], int) or spec[key] < 1:
            raise ValueError(f"serving spec {key} must be a positive int, got {spec[key]!r}")
    for key in ("decode_batch_buckets", "draft_widths"):
        if any(not isinstance(x, int) or x < 1 for x in spec[key]):
            raise ValueError(f"serving spec {key} must hold positive ints, got {spec[key]!r}")
    if spec["head_k_dim"] > 256:
        raise ValueError(f"serving spec head_k_dim {spec['head_k_dim']} > 256 is not supported")


def _calls(spec: dict, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label prefix, thunk) for every call of the serving mix, tensors built on ``device`` (meta: shapes only)."""
    H, K, V = spec["heads"], spec["head_k_dim"], spec["head_v_dim"]
    dt = _DTYPES[spec["dtype"]]
    lb = spec.get("gate_lower_bound")
    lb = None if lb is None else float(lb)
    buckets = sorted(set(spec["decode_batch_buckets"]))
    drafts = sorted(set(d for d in spec["draft_widths"] if d > 1))
    pool_size = max(buckets + [len(PREFILL_CU_SEQLENS) - 1])
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, dtype=dt):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device, dtype)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float32).to(device)

    A_log = randn(H, dtype=torch.float32) * 0.5
    dt_bias = randn(H * K, dtype=torch.float32) * 0.5
    pool = torch.zeros(pool_size, H, K, V, dtype=torch.float32, device=device)

    def layer_inputs(T: int):
        return randn(1, T, H, K), randn(1, T, H, K), randn(1, T, H, V), randn(1, T, H, K), rand(1, T, H)

    if spec["prefill"]:
        cu = torch.tensor(PREFILL_CU_SEQLENS, dtype=torch.int32)  # small index tensor: real, on the CPU
        N = len(PREFILL_CU_SEQLENS) - 1

        def prefill():
            q, k, v, g, beta = layer_inputs(PREFILL_CU_SEQLENS[-1])
            idx = torch.arange(N, dtype=torch.int32).to(device)
            return chunk_kda_fwd(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
                                 output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True, A_log=A_log,
                                 dt_bias=dt_bias, lower_bound=lb)
        yield "prefill", prefill

    def recurrent(bs: int, draft: int):
        def call():
            q, k, v, g, beta = layer_inputs(bs * draft)
            idx = torch.arange(bs, dtype=torch.int32).to(device)
            return recurrent_kda(q, k, v, g, beta, pool, idx, draft_width=draft, use_qk_l2norm=True, A_log=A_log,
                                 dt_bias=dt_bias, lower_bound=lb)
        return call

    for bs in buckets:
        yield f"decode[bs={bs}]", recurrent(bs, 1)
    for bs in buckets:
        for d in drafts:
            yield f"verify[bs={bs},draft={d}]", recurrent(bs, d)


def _kernel_name(kernel) -> str:
    for name, entry in REGISTRY.items():
        if kernel is entry.kernel or kernel is getattr(entry.kernel, "fn", None):
            return name
    return getattr(kernel, "__name__", type(kernel).__name__)


def launches(spec: dict) -> list[Launch]:
    """Every kernel launch of the serving mix on ``spec["backend"]``, captured on meta tensors (nothing runs)."""
    _check(spec)
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
    _check(spec)
    with use(spec["backend"]):
        for _, call in _calls(spec, device):
            call()
