"""Token-recurrent KDA for decode (1 token per sequence) and speculative verify (``draft_width`` tokens each).

Tokens are packed [1, N * D, H, *]: sequence n owns tokens n*D .. n*D + D - 1. The draft width D is a constexpr
(the manifest declares the widths a deployment verifies with); the number of sequences N is a runtime int that is
never specialized, so a decode or verify batch of any size runs the same compiled variant. The grid is a function
of the token-count bucket (next power of 2 of N * D) only, so it stays fixed inside a CUDA-graph bucket; slots past
the N live sequences exit. States live in a pool [P, H, K, V] fp32 indexed per sequence (index < 0: padding slot,
skipped). Decode (D == 1) updates the pool in place; verify (D > 1) leaves it and writes the state after every draft
token to ``intermediate`` [N, D, H, K, V] fp32 so the caller can keep the accepted prefix.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import activations, as_index, as_pool, as_read, canonical, cdiv, gate, next_pow2

PINNED = {"BV": 32, "num_warps": 4, "num_stages": 3}
DEFAULT = {"BV": 32, "num_warps": 4, "num_stages": 2}


@triton.jit(do_not_specialize=["N"])
def kda_recurrent_kernel(q, k, v, g, beta, A_log, dt_bias, o, pool, indices, inter, scale, lower_bound, N,
                         DRAFT: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, GATE: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    i_v, i_nh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    if i_n >= N:
        return
    i_s = tl.load(indices + i_n).to(tl.int64)
    if i_s < 0:
        return
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    p_s = pool + (i_s * H + i_h) * K * V + p_kv
    b_h = tl.load(p_s, mask=m_kv, other=0.0)
    if GATE != 0:
        b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0)
        b_a = tl.exp(tl.load(A_log + i_h))
    for i_d in range(DRAFT):
        i_tok = i_n * DRAFT + i_d
        p_k = (i_tok * H + i_h) * K + o_k
        b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (i_tok * H + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_b = tl.load(beta + i_tok * H + i_h).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        if GATE == 1:
            b_x = b_g + b_bias
            b_g = -b_a * tl.where(b_x > 20.0, b_x, tl.log(1.0 + tl.exp(tl.minimum(b_x, 20.0))))
        elif GATE == 2:
            b_g = lower_bound * tl.sigmoid(b_a * (b_g + b_bias))
        b_h = b_h * tl.exp(tl.where(m_k, b_g, 0.0))[:, None]
        b_d = b_b * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h = b_h + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + (i_tok * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if DRAFT > 1:
            tl.store(inter + ((i_n * DRAFT + i_d) * H + i_h) * K * V + p_kv, b_h, mask=m_kv)
    if DRAFT == 1:
        tl.store(p_s, b_h, mask=m_kv)


register("recurrent", Entry(kda_recurrent_kernel, PINNED, autotune_default=False, default_config=DEFAULT))


def token_bucket(num_tokens: int) -> int:
    """The grid's token capacity: next power of 2 (a CUDA graph captured at a bucket replays the same grid)."""
    return next_pow2(max(int(num_tokens), 1))


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float | None = None,
                  draft_width: int = 1, use_qk_l2norm: bool = False, A_log: torch.Tensor | None = None,
                  dt_bias: torch.Tensor | None = None,
                  lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o [1, N*D, H, V], intermediate [N, D, H, K, V] fp32 for verify (D > 1) else None).

    Decode (D == 1) advances the pool in place; verify (D > 1) leaves it. q, k, v share the activation dtype; g is
    the log-decay or, with A_log / dt_bias, the raw gate; beta, A_log, dt_bias may be any float dtype (used in
    fp32; beta read as given when fp32 or the activation dtype, see ``common.as_read``); ``state_indices`` int32 or
    int64. Views and unaligned inputs are copied once (``common.canonical``).
    """
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be packed [1, N*D, H, K], got shape {tuple(q.shape)}")
    _, T, H, K = q.shape
    V = v.shape[-1]
    D = int(draft_width)
    if D < 1:
        raise ValueError(f"draft_width must be >= 1, got {D}")
    if state_indices.dim() != 1:
        raise ValueError(f"state_indices must be [N], got shape {tuple(state_indices.shape)}")
    N = state_indices.shape[0]
    if T != N * D:
        raise ValueError(f"q holds {T} tokens but {N} sequences x draft_width {D} = {N * D}")
    q, k, v = activations(q, k, v, (1, T, H, K), (1, T, H, V))
    g = canonical("g", g, (1, T, H, K))
    beta = as_read("beta", beta, (1, T, H), q.dtype)
    state_indices = as_index("state_indices", state_indices, (N,))
    pool = as_pool("state_pool", state_pool, H, K, V)
    gt = gate(A_log, dt_bias, lower_bound, H, K)
    scale = K ** -0.5 if scale is None else float(scale)
    o = torch.empty_like(v)
    inter = torch.empty(N, D, H, K, V, dtype=torch.float32, device=q.device) if D > 1 else None
    slots = cdiv(token_bucket(T), D)
    dispatch("recurrent", lambda meta: (cdiv(V, meta["BV"]), slots * H), q, k, v, g, beta, gt.A_log,
             gt.dt_bias, o, pool, state_indices, inter, scale, gt.lower_bound, N, DRAFT=D, H=H, K=K, V=V,
             BK=next_pow2(K), GATE=gt.kind, USE_QK_L2NORM=bool(use_qk_l2norm))
    return o, inter
