"""Token-recurrent KDA for decode (1 token per sequence) and speculative verify (``draft_width`` tokens each).

Tokens are packed [1, N * D, H, *]: sequence n owns tokens n*D .. n*D + D - 1. As in the public serving
kernels, the draft width D and the token-count bucket (next power of 2 of N * D) are constexprs: the grid is a
function of the bucket only (CUDA-graph friendly; slots past the N live sequences exit), so each (bucket, draft
width) is one compiled variant. States live in a pool [P, H, K, V] fp32 indexed per sequence (index < 0: padding
slot, skipped). Decode updates the pool in place; verify leaves it and writes the state after every draft token to
``intermediate`` [N, D, H, K, V] fp32 so the caller can keep the accepted prefix.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import check
from .cumsum import GATE_LOWER_BOUND, GATE_NONE, GATE_SOFTPLUS

PINNED = {"BV": 32, "num_warps": 4, "num_stages": 3}
DEFAULT = {"BV": 32, "num_warps": 4, "num_stages": 2}


@triton.jit(do_not_specialize=["N"])
def kda_recurrent_kernel(q, k, v, g, beta, A_log, dt_bias, o, pool, indices, inter, scale, lower_bound, N,
                         T_BUCKET: tl.constexpr, DRAFT: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                         USE_QK_L2NORM: tl.constexpr, UPDATE_STATE: tl.constexpr, STORE_INTER: tl.constexpr):
    i_v, i_nh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    if i_n >= N or i_n * DRAFT >= T_BUCKET:
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
    b_h = tl.load(p_s, mask=m_kv, other=0.0).to(tl.float32)
    if GATE != 0:
        b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
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
        if STORE_INTER:
            tl.store(inter + ((i_n * DRAFT + i_d) * H + i_h) * K * V + p_kv, b_h, mask=m_kv)
    if UPDATE_STATE:
        tl.store(p_s, b_h.to(pool.dtype.element_ty), mask=m_kv)


register("recurrent", Entry(kda_recurrent_kernel, PINNED, autotune_default=False, default_config=DEFAULT))


def token_bucket(num_tokens: int) -> int:
    return triton.next_power_of_2(max(int(num_tokens), 1))


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float | None = None,
                  draft_width: int = 1, use_qk_l2norm: bool = False, A_log: torch.Tensor | None = None,
                  dt_bias: torch.Tensor | None = None, lower_bound: float | None = None,
                  update_state: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o [1, N*D, H, V], intermediate [N, D, H, K, V] fp32 for verify (D > 1) else None).

    ``update_state`` defaults to True for decode (D == 1: the pool is advanced in place) and False for verify.
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
    for name, t, shape in [("q", q, (1, T, H, K)), ("k", k, (1, T, H, K)), ("v", v, (1, T, H, V)),
                           ("g", g, (1, T, H, K)), ("beta", beta, (1, T, H))]:
        check(name, t, shape)
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (H, K, V) or state_pool.dtype != torch.float32:
        raise ValueError(f"state_pool must be fp32 [P, H={H}, K={K}, V={V}], got {state_pool.dtype} "
                         f"{tuple(state_pool.shape)}")
    gate = GATE_NONE
    if A_log is not None or dt_bias is not None:
        if A_log is None or dt_bias is None:
            raise ValueError("the fused gate needs both A_log [H] and dt_bias [H*K]")
        check("A_log", A_log, (H,))
        check("dt_bias", dt_bias, (H * K,))
        gate = GATE_SOFTPLUS if lower_bound is None else GATE_LOWER_BOUND
    elif lower_bound is not None:
        raise ValueError("lower_bound applies only to the fused gate (pass A_log and dt_bias)")
    update = (D == 1) if update_state is None else bool(update_state)
    scale = K ** -0.5 if scale is None else float(scale)
    o = torch.empty_like(v)
    inter = torch.empty(N, D, H, K, V, dtype=torch.float32, device=q.device) if D > 1 else None
    bucket = token_bucket(T)
    slots = triton.cdiv(bucket, D)
    dispatch("recurrent", lambda meta: (triton.cdiv(V, meta["BV"]), slots * H), q, k, v, g, beta, A_log, dt_bias,
             o, state_pool, state_indices, inter, scale, float(lower_bound or 0.0), N,
             T_BUCKET=bucket, DRAFT=D, H=H, K=K, V=V, BK=triton.next_power_of_2(K), GATE=gate,
             USE_QK_L2NORM=bool(use_qk_l2norm), UPDATE_STATE=update, STORE_INTER=inter is not None)
    return o, inter
