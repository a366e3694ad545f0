"""Intra-chunk matrices over 16-token sub-chunks, in fp32.

Akk[i, j] = beta_i * sum_c k_ic k_jc exp(G_ic - G_jc) (i > j), Aqk[i, j] = scale * sum_c q_ic k_jc exp(G_ic - G_jc)
(i >= j); both [B, T, H, 64], zero above the diagonal. The "inter" kernel fills the off-diagonal 16x16 blocks
(and the zeros above), tiled over K with BK, using the first token of the row sub-chunk as the reference point so
both factors are exponentials of non-positive numbers. The "intra" kernel fills the diagonal blocks column by column
in plain fp32: exp(G_i - G_j) per pair and channel for rows i >= j only, every other exponent masked to -inf.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import AUTOTUNE_CACHE, BC, BT, as_fp32, canonical, check_rstd, chunk_bounds, layout

INTER_CONFIGS = [
    triton.Config({"BK": BK}, num_warps=num_warps, num_stages=num_stages)
    for BK in [16, 32, 64]
    for num_warps in [1, 2, 4, 8]
    for num_stages in [2, 3]
]
INTER_PINNED = {"BK": 64, "num_warps": 4, "num_stages": 3}
INTRA_CONFIGS = [triton.Config({}, num_warps=num_warps, num_stages=3) for num_warps in [1, 2, 4, 8]]
INTRA_PINNED = {"num_warps": 4, "num_stages": 3}


@triton.jit
def _row_factor(G, o_c, m_c, o_k, m_k, i_r, HK):
    """exp(G_row - G_ref) for the rows of one sub-chunk, ref = its first token; 0 on masked rows."""
    b_g = tl.load(G + o_c[:, None] * HK + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0.0)
    b_gn = tl.load(G + i_r * HK + o_k, mask=m_k, other=0.0)
    return tl.exp(tl.where(m_c[:, None], b_g - b_gn[None, :], float("-inf"))), b_gn


@triton.jit
def _col_t(k, G, o_c, o_k, m_k, b_gn, HK):
    """(k_col * exp(G_ref - G_col))^T for an earlier sub-chunk (always complete): [BK, BC]."""
    m = m_k[None, :] & (o_c[:, None] >= 0)
    b_k = tl.load(k + o_c[:, None] * HK + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(G + o_c[:, None] * HK + o_k[None, :], mask=m, other=0.0)
    return tl.trans(b_k * tl.exp(b_gn[None, :] - b_g))


@triton.jit
def _store_row(Aqk, Akk, beta, o_c, m_c, o_i, HBT, H, b_q0, b_k0, b_q1, b_k1, b_q2, b_k2, scale,
               BC: tl.constexpr, R: tl.constexpr):
    """Store the off-diagonal blocks of row sub-chunk R (R blocks) and zero its blocks above the diagonal."""
    b_b = tl.load(beta + o_c * H, mask=m_c, other=0.0)
    m = m_c[:, None] & (o_i[None, :] >= 0)
    p = o_c[:, None] * HBT + o_i[None, :]
    if R >= 1:
        tl.store(Aqk + p, b_q0 * scale, mask=m)
        tl.store(Akk + p, b_k0 * b_b[:, None], mask=m)
    if R >= 2:
        tl.store(Aqk + p + BC, b_q1 * scale, mask=m)
        tl.store(Akk + p + BC, b_k1 * b_b[:, None], mask=m)
    if R >= 3:
        tl.store(Aqk + p + 2 * BC, b_q2 * scale, mask=m)
        tl.store(Akk + p + 2 * BC, b_k2 * b_b[:, None], mask=m)
    b_z = tl.zeros([BC, BC], dtype=tl.float32)
    for c in tl.static_range(R + 1, 4):
        tl.store(Aqk + p + c * BC, b_z, mask=m)
        tl.store(Akk + p + c * BC, b_z, mask=m)


@triton.autotune(configs=INTER_CONFIGS, key=["H", "K"], **AUTOTUNE_CACHE)
@triton.jit
def kda_intra_inter_kernel(q, k, G, beta, q_rstd, k_rstd, Aqk, Akk, cu_seqlens, chunk_indices, scale,
                           H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                           NORM_QK: tl.constexpr):
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_t, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
    base = (bos * H + i_h)
    q += base * K
    k += base * K
    G += base * K
    beta += base
    Aqk += base * BT
    Akk += base * BT
    HK = H * K
    o_i = tl.arange(0, BC)
    i_r0 = i_t * BT
    i_r1 = i_r0 + BC
    i_r2 = i_r0 + 2 * BC
    i_r3 = i_r0 + 3 * BC
    o_c0, o_c1, o_c2, o_c3 = i_r0 + o_i, i_r1 + o_i, i_r2 + o_i, i_r3 + o_i
    m_c0, m_c1, m_c2, m_c3 = o_c0 < T, o_c1 < T, o_c2 < T, o_c3 < T

    b_q10 = tl.zeros([BC, BC], dtype=tl.float32)
    b_k10 = tl.zeros([BC, BC], dtype=tl.float32)
    b_q20 = tl.zeros([BC, BC], dtype=tl.float32)
    b_k20 = tl.zeros([BC, BC], dtype=tl.float32)
    b_q21 = tl.zeros([BC, BC], dtype=tl.float32)
    b_k21 = tl.zeros([BC, BC], dtype=tl.float32)
    b_q30 = tl.zeros([BC, BC], dtype=tl.float32)
    b_k30 = tl.zeros([BC, BC], dtype=tl.float32)
    b_q31 = tl.zeros([BC, BC], dtype=tl.float32)
    b_k31 = tl.zeros([BC, BC], dtype=tl.float32)
    b_q32 = tl.zeros([BC, BC], dtype=tl.float32)
    b_k32 = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        if i_r1 < T:
            b_e1, b_gn1 = _row_factor(G, o_c1, m_c1, o_k, m_k, i_r1, HK)
            m1 = m_c1[:, None] & m_k[None, :]
            b_qg1 = tl.load(q + o_c1[:, None] * HK + o_k[None, :], mask=m1, other=0.0).to(tl.float32) * b_e1
            b_kg1 = tl.load(k + o_c1[:, None] * HK + o_k[None, :], mask=m1, other=0.0).to(tl.float32) * b_e1
            b_ct = _col_t(k, G, o_c0, o_k, m_k, b_gn1, HK)
            b_q10 = tl.dot(b_qg1, b_ct, b_q10)
            b_k10 = tl.dot(b_kg1, b_ct, b_k10)
        if i_r2 < T:
            b_e2, b_gn2 = _row_factor(G, o_c2, m_c2, o_k, m_k, i_r2, HK)
            m2 = m_c2[:, None] & m_k[None, :]
            b_qg2 = tl.load(q + o_c2[:, None] * HK + o_k[None, :], mask=m2, other=0.0).to(tl.float32) * b_e2
            b_kg2 = tl.load(k + o_c2[:, None] * HK + o_k[None, :], mask=m2, other=0.0).to(tl.float32) * b_e2
            b_ct = _col_t(k, G, o_c0, o_k, m_k, b_gn2, HK)
            b_q20 = tl.dot(b_qg2, b_ct, b_q20)
            b_k20 = tl.dot(b_kg2, b_ct, b_k20)
            b_ct = _col_t(k, G, o_c1, o_k, m_k, b_gn2, HK)
            b_q21 = tl.dot(b_qg2, b_ct, b_q21)
            b_k21 = tl.dot(b_kg2, b_ct, b_k21)
        if i_r3 < T:
            b_e3, b_gn3 = _row_factor(G, o_c3, m_c3, o_k, m_k, i_r3, HK)
            m3 = m_c3[:, None] & m_k[None, :]
            b_qg3 = tl.load(q + o_c3[:, None] * HK + o_k[None, :], mask=m3, other=0.0).to(tl.float32) * b_e3
            b_kg3 = tl.load(k + o_c3[:, None] * HK + o_k[None, :], mask=m3, other=0.0).to(tl.float32) * b_e3
            b_ct = _col_t(k, G, o_c0, o_k, m_k, b_gn3, HK)
            b_q30 = tl.dot(b_qg3, b_ct, b_q30)
            b_k30 = tl.dot(b_kg3, b_ct, b_k30)
            b_ct = _col_t(k, G, o_c1, o_k, m_k, b_gn3, HK)
            b_q31 = tl.dot(b_qg3, b_ct, b_q31)
            b_k31 = tl.dot(b_kg3, b_ct, b_k31)
            b_ct = _col_t(k, G, o_c2, o_k, m_k, b_gn3, HK)
            b_q32 = tl.dot(b_qg3, b_ct, b_q32)
            b_k32 = tl.dot(b_kg3, b_ct, b_k32)
    if NORM_QK:  # A is bilinear in rows and columns: apply the L2 norms to the blocks
        rk0 = tl.load(k_rstd + base + o_c0 * H, mask=m_c0, other=0.0)
        rk1 = tl.load(k_rstd + base + o_c1 * H, mask=m_c1, other=0.0)
        rk2 = tl.load(k_rstd + base + o_c2 * H, mask=m_c2, other=0.0)
        rk3 = tl.load(k_rstd + base + o_c3 * H, mask=m_c3, other=0.0)
        rq1 = tl.load(q_rstd + base + o_c1 * H, mask=m_c1, other=0.0)
        rq2 = tl.load(q_rstd + base + o_c2 * H, mask=m_c2, other=0.0)
        rq3 = tl.load(q_rstd + base + o_c3 * H, mask=m_c3, other=0.0)
        b_q10 *= rq1[:, None] * rk0[None, :]
        b_k10 *= rk1[:, None] * rk0[None, :]
        b_q20 *= rq2[:, None] * rk0[None, :]
        b_k20 *= rk2[:, None] * rk0[None, :]
        b_q21 *= rq2[:, None] * rk1[None, :]
        b_k21 *= rk2[:, None] * rk1[None, :]
        b_q30 *= rq3[:, None] * rk0[None, :]
        b_k30 *= rk3[:, None] * rk0[None, :]
        b_q31 *= rq3[:, None] * rk1[None, :]
        b_k31 *= rk3[:, None] * rk1[None, :]
        b_q32 *= rq3[:, None] * rk2[None, :]
        b_k32 *= rk3[:, None] * rk2[None, :]
    HBT = H * BT
    b_z = tl.zeros([BC, BC], dtype=tl.float32)
    _store_row(Aqk, Akk, beta, o_c0, m_c0, o_i, HBT, H, b_z, b_z, b_z, b_z, b_z, b_z, scale, BC, 0)
    _store_row(Aqk, Akk, beta, o_c1, m_c1, o_i, HBT, H, b_q10, b_k10, b_z, b_z, b_z, b_z, scale, BC, 1)
    _store_row(Aqk, Akk, beta, o_c2, m_c2, o_i, HBT, H, b_q20, b_k20, b_q21, b_k21, b_z, b_z, scale, BC, 2)
    _store_row(Aqk, Akk, beta, o_c3, m_c3, o_i, HBT, H, b_q30, b_k30, b_q31, b_k31, b_q32, b_k32, scale, BC, 3)


@triton.autotune(configs=INTRA_CONFIGS, key=["H", "K"], **AUTOTUNE_CACHE)
@triton.jit
def kda_intra_diag_kernel(q, k, G, beta, q_rstd, k_rstd, Aqk, Akk, cu_seqlens, chunk_indices, scale,
                          H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                          NORM_QK: tl.constexpr):
    i_tc, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_t, i_c = i_tc // (BT // BC), i_tc % (BT // BC)
    i_t, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
    i_r = i_t * BT + i_c * BC
    if i_r >= T:
        return
    base = (bos * H + i_h)
    HK = H * K
    o_i = tl.arange(0, BC)
    o_c = i_r + o_i
    m_c = o_c < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m = m_c[:, None] & m_k[None, :]
    p = (base * K) + o_c[:, None] * HK + o_k[None, :]
    b_q = tl.load(q + p, mask=m, other=0.0).to(tl.float32)
    b_k = tl.load(k + p, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(G + p, mask=m, other=0.0)
    b_aqk = tl.zeros([BC, BC], dtype=tl.float32)
    b_akk = tl.zeros([BC, BC], dtype=tl.float32)
    # Column j: sum_c x_ic k_jc exp(G_ic - G_jc) for rows i >= j. Elementwise fp32 rather than the dots of the
    # inter kernel: a reference-token split of a 16x16 block needs 4 levels of small dots, whose operands kept
    # 255 registers live (spilling) and ran 1.3x slower on the H200 (scratch measurement, see kernels/README.md).
    for j in tl.static_range(BC):
        m_j = m_k & (i_r + j < T)
        p_j = base * K + (i_r + j) * HK + o_k
        b_kj = tl.load(k + p_j, mask=m_j, other=0.0).to(tl.float32)
        b_gj = tl.load(G + p_j, mask=m_j, other=0.0)
        b_kje = tl.exp(tl.where(((o_i >= j) & m_c)[:, None], b_g - b_gj[None, :], float("-inf"))) * b_kj[None, :]
        b_aqk = tl.where(o_i[None, :] == j, tl.sum(b_q * b_kje, 1)[:, None], b_aqk)
        b_akk = tl.where(o_i[None, :] == j, tl.sum(b_k * b_kje, 1)[:, None], b_akk)
    b_akk = tl.where(o_i[:, None] > o_i[None, :], b_akk, 0.0)  # Akk is strictly lower triangular
    if NORM_QK:
        rq = tl.load(q_rstd + base + o_c * H, mask=m_c, other=0.0)
        rk = tl.load(k_rstd + base + o_c * H, mask=m_c, other=0.0)
        b_aqk *= rq[:, None] * rk[None, :]
        b_akk *= rk[:, None] * rk[None, :]
    b_b = tl.load(beta + base + o_c * H, mask=m_c, other=0.0)
    p_A = base * BT + o_c[:, None] * (H * BT) + (i_c * BC + o_i)[None, :]
    m_A = m_c[:, None] & (o_i[None, :] >= 0)
    tl.store(Aqk + p_A, b_aqk * scale, mask=m_A)
    tl.store(Akk + p_A, b_akk * b_b[:, None], mask=m_A)


register("intra_inter", Entry(kda_intra_inter_kernel, INTER_PINNED))
register("intra_diag", Entry(kda_intra_diag_kernel, INTRA_PINNED))


def chunk_intra(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, beta: torch.Tensor, scale: float,
                cu_seqlens: torch.Tensor | None = None, q_rstd: torch.Tensor | None = None,
                k_rstd: torch.Tensor | None = None, *, _layout=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Akk, Aqk), each [B, T, H, 64] fp32, from q, k [B, T, H, K], fp32 cumsum G and beta [B, T, H] (any float
    dtype: read as fp32). With ``q_rstd``/``k_rstd`` (fp32 [B, T, H], from :func:`l2norm_rstd`) q and k count as
    L2-normalised."""
    L = _layout or layout(k, None, cu_seqlens)
    q = canonical("q", q, (L.B, L.T, L.H, L.K))
    k = canonical("k", k, (L.B, L.T, L.H, L.K))
    G = canonical("G", G, (L.B, L.T, L.H, L.K), (torch.float32,))
    beta = as_fp32("beta", beta, (L.B, L.T, L.H))
    Akk = torch.empty(L.B, L.T, L.H, BT, dtype=torch.float32, device=k.device)
    Aqk = torch.empty_like(Akk)
    q_rstd, k_rstd = check_rstd(q_rstd, k_rstd, L)
    args = (q, k, G, beta, q_rstd, k_rstd, Aqk, Akk, L.cu_seqlens, L.chunk_indices, float(scale))
    kw = dict(H=L.H, K=L.K, BT=BT, BC=BC, NORM_QK=q_rstd is not None)
    dispatch("intra_inter", lambda meta: (L.NT, L.H), *args, **kw)
    dispatch("intra_diag", lambda meta: (L.NT * (BT // BC), L.H), *args, BK=triton.next_power_of_2(L.K), **kw)
    return Akk, Aqk
