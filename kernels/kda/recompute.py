"""WY recompute per chunk: w = Ainv (beta * k * 2^G), u = Ainv (beta * v), kg = k * 2^(G_last - G).

w, u, kg are stored in the input dtype (bf16 in serving). The dots take their operands in Ainv's dtype (k's, from
chunk_intra): bf16 tensor cores in serving, like fla (0.31 ms, not 0.41, on the H200 at H=32, T=16384); with output's
bf16 Aqk this moved the accuracy bench's chunked o error from 2.5e-3 to 3.4e-3 (bound 5e-3).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import AUTOTUNE_CACHE, BT, as_fp32, canonical, chunk_bounds, layout

# Whole 128-wide rows (one K and one V tile at K = V = 128) won at 7 of 8 points of a one-off sweep on the H200
# (20 configs; fla's 9 alongside): 0.278 ms at H=32, T=16384, where fla's best is 0.286 ms and this list's 64-wide
# tiles at 2 stages (before) 0.335 ms. The 64-wide single-stage pair won at the smallest batch (3k tokens).
CONFIGS = [
    triton.Config({"BK": BK, "BV": BV}, num_warps=num_warps, num_stages=num_stages)
    for BK, BV, num_warps, num_stages in [(128, 128, 4, 2), (128, 128, 4, 3), (64, 64, 4, 1), (64, 64, 8, 1)]
]
PINNED = {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3}


@triton.autotune(configs=CONFIGS, key=["H", "K", "V", "t_bucket"], **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=["t_bucket"])
def kda_recompute_kernel(k, v, beta, G, Ai, k_rstd, w, u, kg, cu_seqlens, chunk_indices, t_bucket, H: tl.constexpr,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         NORM_K: tl.constexpr):
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_t, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
    base = bos * H + i_h
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    i_last = tl.minimum(i_t * BT + BT, T) - 1
    b_A = tl.load(Ai + base * BT + o_t[:, None] * (H * BT) + tl.arange(0, BT)[None, :],
                  mask=m_t[:, None], other=0.0)
    b_b = tl.load(beta + base + o_t * H, mask=m_t, other=0.0)
    if NORM_K:
        b_rk = tl.load(k_rstd + base + o_t * H, mask=m_t, other=0.0)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m = m_t[:, None] & (o_v < V)[None, :]
        p = base * V + o_t[:, None] * (H * V) + o_v[None, :]
        b_vb = tl.load(v + p, mask=m, other=0.0).to(tl.float32) * b_b[:, None]
        tl.store(u + p, tl.dot(b_A, b_vb.to(b_A.dtype)).to(u.dtype.element_ty), mask=m)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        p = base * K + o_t[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + p, mask=m, other=0.0).to(tl.float32)
        if NORM_K:
            b_k = b_k * b_rk[:, None]
        b_g = tl.load(G + p, mask=m, other=0.0)
        b_gl = tl.load(G + base * K + i_last * (H * K) + o_k, mask=o_k < K, other=0.0)
        b_kb = b_k * b_b[:, None] * tl.exp2(b_g)
        tl.store(w + p, tl.dot(b_A, b_kb.to(b_A.dtype)).to(w.dtype.element_ty), mask=m)
        b_kg = b_k * tl.exp2(tl.where(m, b_gl[None, :] - b_g, float("-inf")))
        tl.store(kg + p, b_kg.to(kg.dtype.element_ty), mask=m)


register("recompute", Entry(kda_recompute_kernel, PINNED))


def chunk_recompute(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, G: torch.Tensor, Ai: torch.Tensor,
                    cu_seqlens: torch.Tensor | None = None, k_rstd: torch.Tensor | None = None, *, _layout=None):
    """(w [B,T,H,K], u [B,T,H,V], kg [B,T,H,K]) in k's / v's dtype; ``k_rstd`` L2-normalises k."""
    L = _layout or layout(k, v, cu_seqlens)
    k = canonical("k", k, (L.B, L.T, L.H, L.K))
    v = canonical("v", v, (L.B, L.T, L.H, L.V))
    beta = as_fp32("beta", beta, (L.B, L.T, L.H))
    G = canonical("G", G, (L.B, L.T, L.H, L.K), (torch.float32,))
    Ai = canonical("Ainv", Ai, (L.B, L.T, L.H, BT))
    if k_rstd is not None:
        k_rstd = canonical("k_rstd", k_rstd, (L.B, L.T, L.H), (torch.float32,))
    w, kg, u = torch.empty_like(k), torch.empty_like(k), torch.empty_like(v)
    dispatch("recompute", lambda meta: (L.NT, L.H), k, v, beta, G, Ai, k_rstd, w, u, kg, L.cu_seqlens,
             L.chunk_indices, L.bucket, H=L.H, K=L.K, V=L.V, BT=BT, NORM_K=k_rstd is not None)
    return w, u, kg
