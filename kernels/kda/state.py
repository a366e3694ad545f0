"""Chunk state recurrence, sequential over the chunks of each sequence, state in fp32 registers.

For each chunk: store h_c (input dtype); v_new = u - w h; h <- exp(G_last) h + kg^T v_new. The initial state of
sequence n is pool[indices[n]] (or pool[n] without indices); the final state is returned in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import AUTOTUNE_CACHE, BT, check, layout

CONFIGS = [
    triton.Config({"BV": BV}, num_warps=num_warps, num_stages=num_stages)
    for BV in [32, 64]
    for num_warps in [2, 4]
    for num_stages in [2, 3]
]
PINNED = {"BV": 32, "num_warps": 4, "num_stages": 3}


@triton.autotune(configs=CONFIGS, key=["H", "K", "V"], **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=["T", "NT"])
def kda_state_kernel(kg, w, u, G, h, v_new, h0, h0_indices, ht, cu_seqlens, chunk_offsets, T, NT,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, HAS_H0: tl.constexpr, HAS_H0_INDICES: tl.constexpr,
                     STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_v, i_nh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
        NT = tl.cdiv(T, BT)
    else:
        bos = i_n * T
        boh = i_n * NT
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        if HAS_H0_INDICES:
            i_s = tl.load(h0_indices + i_n).to(tl.int64)
        else:
            i_s = i_n
        b_h = tl.load(h0 + (i_s * H + i_h) * K * V + p_kv, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in range(NT):
        tl.store(h + ((boh + i_t) * H + i_h) * K * V + p_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_tk = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
        p_tv = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
        b_u = tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, b_h.to(b_w.dtype))
        tl.store(v_new + p_tv, b_vn.to(v_new.dtype.element_ty), mask=m_tv)
        i_last = tl.minimum(i_t * BT + BT, T) - 1
        b_gl = tl.load(G + ((bos + i_last) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_kg = tl.load(kg + p_tk, mask=m_tk, other=0.0)
        b_h = b_h * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_kg), b_vn.to(b_kg.dtype))
    if STORE_FINAL:
        tl.store(ht + (i_n * H + i_h) * K * V + p_kv, b_h, mask=m_kv)


register("state", Entry(kda_state_kernel, PINNED))


def check_initial_state(initial_state: torch.Tensor | None, initial_state_indices: torch.Tensor | None,
                        L) -> None:
    N = L.num_seqs
    if initial_state is not None:
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (L.H, L.K, L.V):
            raise ValueError(f"initial_state must be a pool [P, H={L.H}, K={L.K}, V={L.V}], got "
                             f"{tuple(initial_state.shape)}")
        if initial_state_indices is None and initial_state.shape[0] != N:
            raise ValueError(f"initial_state has {initial_state.shape[0]} states for {N} sequences; "
                             "pass initial_state_indices to index a larger pool")
    if initial_state_indices is not None:
        if initial_state is None:
            raise ValueError("initial_state_indices given without initial_state")
        if tuple(initial_state_indices.shape) != (N,):
            raise ValueError(f"initial_state_indices must be [N={N}], got {tuple(initial_state_indices.shape)}")


def chunk_state(kg: torch.Tensor, w: torch.Tensor, u: torch.Tensor, G: torch.Tensor,
                initial_state: torch.Tensor | None = None, initial_state_indices: torch.Tensor | None = None,
                output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, *, _layout=None):
    """(h [B, NT, H, K, V] in kg's dtype, v_new [B, T, H, V] in u's dtype, final state [N, H, K, V] fp32 or None)."""
    L = _layout or layout(kg, u, cu_seqlens)
    check("kg", kg, (L.B, L.T, L.H, L.K))
    check("w", w, (L.B, L.T, L.H, L.K))
    check("u", u, (L.B, L.T, L.H, L.V))
    check("G", G, (L.B, L.T, L.H, L.K), (torch.float32,))
    if L.K > 256:
        raise ValueError(f"head_k_dim K={L.K} > 256 is not supported (the state lives in registers)")
    N = L.num_seqs
    check_initial_state(initial_state, initial_state_indices, L)
    NT_seq = triton.cdiv(L.T, BT)
    h = torch.empty(L.B, L.NT if L.index is not None else NT_seq, L.H, L.K, L.V, dtype=kg.dtype, device=kg.device)
    v_new = torch.empty_like(u)
    ht = torch.empty(N, L.H, L.K, L.V, dtype=torch.float32, device=kg.device) if output_final_state else None
    dispatch("state", lambda meta: (triton.cdiv(L.V, meta["BV"]), N * L.H), kg, w, u, G, h, v_new,
             initial_state, initial_state_indices, ht, L.cu_seqlens, L.chunk_offsets, L.T, NT_seq,
             H=L.H, K=L.K, V=L.V, BT=BT, BK=triton.next_power_of_2(L.K), HAS_H0=initial_state is not None,
             HAS_H0_INDICES=initial_state_indices is not None, STORE_FINAL=output_final_state,
             IS_VARLEN=L.index is not None)
    return h, v_new, ht
