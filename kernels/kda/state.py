"""Chunk state recurrence, sequential over the chunks of each sequence, state in fp32 registers.

For each chunk: store h_c (input dtype); v_new = u - w h; h <- 2^G_last h + kg^T v_new. The initial state of
sequence n is pool[indices[n]] (zeros where the index is negative); the final state is always written, fp32. The
kernel has one form: no initial state is a pool whose indices are all -1, a pool without indices is indexed by
arange(N), and the final state is stored whether or not the caller keeps it (a write of N states, no new variant).

A program's run time is its sequence's chunk count, so a batch of uneven sequences is as fast as its longest
sequence's programs start early: the grid puts the sequence last (the GPU starts programs in grid order) and walks
the sequences longest first (``Layout.longest_first``). On the H200 at H=16 (configs as tuned for one sequence:
BV 32, 4 warps, 3 stages), batches of 9 / 19 / 6 uneven sequences took 0.60 / 0.43 / 0.43 ms with the sequence
before the head in the grid and in batch order, 0.41 / 0.35 / 0.31 ms longest first (fla-core 0.6.0's kernel, its
sequences in batch order: 0.42 / 0.37 / 0.32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import AUTOTUNE_CACHE, BT, as_index, as_pool, canonical, cdiv, layout, next_pow2

CONFIGS = [
    triton.Config({"BV": BV}, num_warps=num_warps, num_stages=num_stages)
    for BV in [32, 64]
    for num_warps in [2, 4]
    for num_stages in [2, 3]
]
PINNED = {"BV": 32, "num_warps": 4, "num_stages": 3}


@triton.autotune(configs=CONFIGS, key=["H", "K", "V", "t_bucket"], **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=["t_bucket"])
def kda_state_kernel(kg, w, u, G, h, v_new, h0, h0_indices, ht, cu_seqlens, chunk_offsets, longest_first, t_bucket,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr):
    i_v, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n = tl.load(longest_first + tl.program_id(2)).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    NT = tl.cdiv(T, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    i_s = tl.load(h0_indices + i_n).to(tl.int64)
    b_h = tl.load(h0 + (tl.maximum(i_s, 0) * H + i_h) * K * V + p_kv, mask=m_kv & (i_s >= 0), other=0.0)
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
        b_h = b_h * tl.exp2(b_gl)[:, None] + tl.dot(tl.trans(b_kg), b_vn.to(b_kg.dtype))
    tl.store(ht + (i_n * H + i_h) * K * V + p_kv, b_h, mask=m_kv)


register("state", Entry(kda_state_kernel, PINNED))


def initial_states(initial_state: torch.Tensor | None, initial_state_indices: torch.Tensor | None,
                   L) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pool, int32 indices [N]) checked and canonical; (None, None) without an initial state."""
    N = L.num_seqs
    if initial_state is None:
        if initial_state_indices is not None:
            raise ValueError("initial_state_indices given without initial_state")
        return None, None
    pool = as_pool("initial_state", initial_state, L.H, L.K, L.V)
    if initial_state_indices is None:
        if pool.shape[0] != N:
            raise ValueError(f"initial_state has {pool.shape[0]} states for {N} sequences; "
                             "pass initial_state_indices to index a larger pool")
        return pool, torch.arange(N, dtype=torch.int32, device=pool.device)
    return pool, as_index("initial_state_indices", initial_state_indices, (N,))


def chunk_state(kg: torch.Tensor, w: torch.Tensor, u: torch.Tensor, G: torch.Tensor,
                initial_state: torch.Tensor | None = None, initial_state_indices: torch.Tensor | None = None,
                output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, *, _layout=None):
    """(h [NT, H, K, V] per chunk (numbered over all sequences) in kg's dtype, v_new [B, T, H, V] in u's dtype,
    final state [N, H, K, V] fp32 or None)."""
    L = _layout or layout(kg, u, cu_seqlens)
    kg = canonical("kg", kg, (L.B, L.T, L.H, L.K))
    w = canonical("w", w, (L.B, L.T, L.H, L.K))
    u = canonical("u", u, (L.B, L.T, L.H, L.V))
    G = canonical("G", G, (L.B, L.T, L.H, L.K), (torch.float32,))
    if L.K > 256:
        raise ValueError(f"head_k_dim K={L.K} > 256 is not supported (the state lives in registers)")
    N = L.num_seqs
    pool, indices = initial_states(initial_state, initial_state_indices, L)
    h = torch.empty(L.NT, L.H, L.K, L.V, dtype=kg.dtype, device=kg.device)
    v_new = torch.empty_like(u)
    ht = torch.empty(N, L.H, L.K, L.V, dtype=torch.float32, device=kg.device)
    if pool is None:  # every index -1: zero states, never read (ht stands in for the pool pointer)
        pool, indices = ht, torch.full((N,), -1, dtype=torch.int32, device=kg.device)
    dispatch("state", lambda meta: (cdiv(L.V, meta["BV"]), L.H, N), kg, w, u, G, h, v_new, pool, indices,
             ht, L.cu_seqlens, L.chunk_offsets, L.longest_first, L.bucket, H=L.H, K=L.K, V=L.V, BT=BT,
             BK=next_pow2(L.K))
    return h, v_new, (ht if output_final_state else None)
