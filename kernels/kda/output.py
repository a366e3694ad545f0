"""Output per chunk: o = scale * (q * 2^G) h_c + Aqk v_new (Aqk already holds scale and the causal mask)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import AUTOTUNE_CACHE, BT, canonical, cdiv, chunk_bounds, layout

CONFIGS = [
    triton.Config({"BK": BK, "BV": BV}, num_warps=num_warps, num_stages=2)
    for BK, BV in [(32, 64), (64, 64), (64, 128)]
    for num_warps in [4, 8]
]
PINNED = {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3}


@triton.autotune(configs=CONFIGS, key=["H", "K", "V", "t_bucket"], **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=["t_bucket"])
def kda_output_kernel(q, G, h, Aqk, v_new, q_rstd, o, cu_seqlens, chunk_indices, scale, t_bucket,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, NORM_Q: tl.constexpr):
    i_v, i_ch, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_t, bos, T = chunk_bounds(i_ch, cu_seqlens, chunk_indices)  # h numbers the chunks globally, like the grid
    base = bos * H + i_h
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    if NORM_Q:
        b_rq = tl.load(q_rstd + base + o_t * H, mask=m_t, other=0.0)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m = m_t[:, None] & m_k[None, :]
        p = base * K + o_t[:, None] * (H * K) + o_k[None, :]
        b_q = tl.load(q + p, mask=m, other=0.0).to(tl.float32)
        if NORM_Q:
            b_q = b_q * b_rq[:, None]
        b_g = tl.load(G + p, mask=m, other=0.0)
        b_h = tl.load(h + (i_ch * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o = tl.dot((b_q * tl.exp2(b_g)).to(b_h.dtype), b_h, b_o)
    b_A = tl.load(Aqk + base * BT + o_t[:, None] * (H * BT) + tl.arange(0, BT)[None, :],
                  mask=m_t[:, None], other=0.0)
    p_v = base * V + o_t[:, None] * (H * V) + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_vn = tl.load(v_new + p_v, mask=m_tv, other=0.0)
    b_o = b_o * scale + tl.dot(b_A, b_vn.to(b_A.dtype))  # in Aqk's dtype: bf16 in serving, like fla
    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_tv)


register("output", Entry(kda_output_kernel, PINNED))


def chunk_output(q: torch.Tensor, G: torch.Tensor, h: torch.Tensor, Aqk: torch.Tensor, v_new: torch.Tensor,
                 scale: float, cu_seqlens: torch.Tensor | None = None, q_rstd: torch.Tensor | None = None, *,
                 _layout=None) -> torch.Tensor:
    """o [B, T, H, V] in v_new's dtype; ``q_rstd`` L2-normalises q."""
    L = _layout or layout(q, v_new, cu_seqlens)
    q = canonical("q", q, (L.B, L.T, L.H, L.K))
    G = canonical("G", G, (L.B, L.T, L.H, L.K), (torch.float32,))
    Aqk = canonical("Aqk", Aqk, (L.B, L.T, L.H, BT))
    h = canonical("h", h, (L.NT, L.H, L.K, L.V))
    v_new = canonical("v_new", v_new, (L.B, L.T, L.H, L.V))
    if q_rstd is not None:
        q_rstd = canonical("q_rstd", q_rstd, (L.B, L.T, L.H), (torch.float32,))
    o = torch.empty_like(v_new)
    dispatch("output", lambda meta: (cdiv(L.V, meta["BV"]), L.NT, L.H), q, G, h, Aqk, v_new, q_rstd,
             o, L.cu_seqlens, L.chunk_indices, float(scale), L.bucket, H=L.H, K=L.K, V=L.V, BT=BT,
             NORM_Q=q_rstd is not None)
    return o
