"""Intra-chunk matrices and the WY solve in two kernels (after fla's token-parallel intra + fused inter-solve).

Aqk[i, j] = scale * sum_c q_ic k_jc 2^(G_ic - G_jc) (i >= j) and Akk[i, j] = beta_i * sum_c k_ic k_jc 2^(G_ic - G_jc)
(i > j; G in base 2, see cumsum.py) over each 64-token chunk, in 16-token sub-chunks; the outputs are Aqk and Ainv = (I + Akk)^-1, both
[B, T, H, 64] in k's dtype, zero above the diagonal. Everything is computed in fp32 and rounded once at the store.

- "intra_token": the diagonal 16x16 blocks, one row token at a time: each row loops over the earlier tokens of its
  sub-chunk only (the causal triangle: about half the exps of a block-wide pass), for BH heads at once. It writes
  its 16-wide row of Aqk in place and its row of Akk's diagonal block to a [B, T, H, 16] fp32 buffer. A program
  covers TB rows of one chunk: the grid is (chunks * 64 / TB, heads / BH). CUDA runs one row per program and stores
  each value as it is summed (like fla; gathering the row first took 0.56 ms, not 0.46, at H=32, T=16384 on the
  H200); the NPU pins TB = 64: one program per chunk and head like every other chunk kernel, far below
  triton-ascend's 65,535-program grid limit, each row gathered and stored as one vector.
- "inter_solve": per chunk and head, the off-diagonal blocks of both matrices by dots over K tiles (reference point:
  the row sub-chunk's first token, so both factors are exponentials of non-positive numbers). Aqk's are stored;
  Akk's stay in registers. The diagonal blocks' inverses come from a product of four factors (no serial
  substitution: with one, loading its rows from memory, the fused kernel took 0.83 ms on the H200 at H=32,
  T=16384; see kernels/README.md), then Ainv's blocks below the diagonal by block products. CUDA's dots are tf32
  for the block products and 3xtf32 for the inverses; the NPU pins ieee (triton-ascend has no tf32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import AUTOTUNE_CACHE, BC, BT, as_fp32, canonical, cdiv, check_rstd, chunk_bounds, layout, next_pow2

# one row per program on CUDA; the NPU pins TB = 64 rows (one program per chunk and head: below its grid limit)
TOKEN_CONFIGS = [
    triton.Config({"TB": 1, "BH": BH}, num_warps=num_warps, num_stages=2)
    for BH, num_warps in [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4)]
]
TOKEN_PINNED = {"TB": BT, "BH": 1, "num_warps": 4, "num_stages": 3}
# tensor-core dots: tf32 for the block products (like fla), 3xtf32 (fp32-accurate) for the diagonal inverses of an
# fp16 / fp32 Ainv; a bf16 Ainv (8 bits kept) takes them in tf32 too: 0.36 instead of 0.42 ms on the H200 at H=32,
# T=16384 (fla's kernel: 0.41 ms), accuracy bench unchanged (bench/results/kda_accuracy.json). triton-ascend has
# ieee and hf32 only
SOLVE_CONFIGS = [
    triton.Config({"BK": BK, "DOT_PREC": "tf32", "INV_PREC": "tf32x3"}, num_warps=num_warps, num_stages=2)
    for BK in [32, 64]
    for num_warps in [1, 2, 4]
]
SOLVE_PINNED = {"BK": 64, "DOT_PREC": "ieee", "INV_PREC": "ieee", "num_warps": 4, "num_stages": 3}


@triton.autotune(configs=TOKEN_CONFIGS, key=["H", "K", "t_bucket"], **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=["t_bucket"])
def kda_intra_token_kernel(q, k, G, beta, q_rstd, k_rstd, Aqk, Akd, cu_seqlens, chunk_indices, scale, t_bucket,
                           H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                           TB: tl.constexpr, BH: tl.constexpr, NORM_QK: tl.constexpr):
    i_tb, i_hb = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_t, bos, T = chunk_bounds(i_tb // (BT // TB), cu_seqlens, chunk_indices)
    r0 = i_t * BT + (i_tb % (BT // TB)) * TB  # this program's first row, counted from the sequence start
    o_h = i_hb * BH + tl.arange(0, BH)
    m_h = o_h < H
    o_k = tl.arange(0, BK)
    m_hk = m_h[:, None] & (o_k < K)[None, :]
    o_j = tl.arange(0, BC)
    HK = H * K
    p_hk = bos * HK + o_h[:, None] * K + o_k[None, :]
    for r in range(TB):
        i = r0 + r
        if i < T:
            p_i = p_hk + i * HK
            b_q = tl.load(q + p_i, mask=m_hk, other=0.0).to(tl.float32)
            b_k = tl.load(k + p_i, mask=m_hk, other=0.0).to(tl.float32)
            b_g = tl.load(G + p_i, mask=m_hk, other=0.0)
            i_l = i % BC  # the row's place in its sub-chunk
            i_s = i - i_l
            p_row = ((bos + i) * H + o_h)
            f_q = tl.zeros([BH], dtype=tl.float32) + scale  # the row's factors: scale, beta, the L2 norms
            f_k = tl.load(beta + (bos + i) * H + o_h, mask=m_h, other=0.0).to(tl.float32)
            if NORM_QK:  # A is bilinear in rows and columns: the L2 norms apply to the row and column sums
                f_q *= tl.load(q_rstd + (bos + i) * H + o_h, mask=m_h, other=0.0)
                f_k *= tl.load(k_rstd + (bos + i) * H + o_h, mask=m_h, other=0.0)
            if TB == 1:
                # zeros right of the diagonal (Aqk) and from it on (Akk: strictly lower), then each earlier token's
                # value as it is summed: a row gathered in registers costs a layout conversion per token
                b_z = tl.zeros([BH, BC], dtype=tl.float32)
                tl.store(Aqk + p_row[:, None] * BT + (i_s % BT + o_j)[None, :], b_z.to(Aqk.dtype.element_ty),
                         mask=m_h[:, None] & (o_j > i_l)[None, :])
                tl.store(Akd + p_row[:, None] * BC + o_j[None, :], b_z, mask=m_h[:, None] & (o_j >= i_l)[None, :])
                for j in range(i_s, i + 1):
                    p_j = p_hk + j * HK
                    b_kj = tl.load(k + p_j, mask=m_hk, other=0.0).to(tl.float32)
                    b_gj = tl.load(G + p_j, mask=m_hk, other=0.0)
                    b_kje = b_kj * tl.exp2(b_g - b_gj)  # G_i - G_j <= 0 for j <= i
                    s_q = tl.sum(b_q * b_kje, 1) * f_q
                    s_k = tl.sum(b_k * b_kje, 1) * f_k
                    if NORM_QK:
                        rk_j = tl.load(k_rstd + (bos + j) * H + o_h, mask=m_h, other=0.0)
                        s_q *= rk_j
                        s_k *= rk_j
                    tl.store(Aqk + p_row * BT + j % BT, s_q.to(Aqk.dtype.element_ty), mask=m_h)
                    tl.store(Akd + p_row * BC + (j - i_s), s_k, mask=m_h & (j < i))
            else:  # the NPU: the row gathered in registers, stored as one vector
                b_aqk = tl.zeros([BH, BC], dtype=tl.float32)
                b_akk = tl.zeros([BH, BC], dtype=tl.float32)
                for j in range(i_s, i + 1):
                    p_j = p_hk + j * HK
                    b_kj = tl.load(k + p_j, mask=m_hk, other=0.0).to(tl.float32)
                    b_gj = tl.load(G + p_j, mask=m_hk, other=0.0)
                    b_kje = b_kj * tl.exp2(b_g - b_gj)
                    m_col = (o_j == j - i_s)[None, :]
                    b_aqk = tl.where(m_col, tl.sum(b_q * b_kje, 1)[:, None], b_aqk)
                    b_akk = tl.where(m_col, tl.sum(b_k * b_kje, 1)[:, None], b_akk)
                b_akk = tl.where((o_j < i_l)[None, :], b_akk, 0.0)
                b_aqk *= f_q[:, None]
                b_akk *= f_k[:, None]
                if NORM_QK:
                    m_cols = m_h[:, None] & (o_j <= i_l)[None, :]
                    rk_j = tl.load(k_rstd + (bos + i_s + o_j)[None, :] * H + o_h[:, None], mask=m_cols, other=0.0)
                    b_aqk *= rk_j
                    b_akk *= rk_j
                m_row = m_h[:, None] & (o_j >= 0)[None, :]
                tl.store(Aqk + p_row[:, None] * BT + (i_s % BT + o_j)[None, :], b_aqk.to(Aqk.dtype.element_ty),
                         mask=m_row)
                tl.store(Akd + p_row[:, None] * BC + o_j[None, :], b_akk, mask=m_row)


@triton.jit
def _row_factor(G, o_c, m_c, o_k, m_k, i_r, HK):
    """2^(G_row - G_ref) for the rows of one sub-chunk, ref = its first token; 0 on masked rows."""
    b_g = tl.load(G + o_c[:, None] * HK + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0.0)
    b_gn = tl.load(G + i_r * HK + o_k, mask=m_k, other=0.0)
    return tl.exp2(tl.where(m_c[:, None], b_g - b_gn[None, :], float("-inf"))), b_gn


@triton.jit
def _col_t(k, G, o_c, o_k, m_k, b_gn, HK):
    """(k_col * 2^(G_ref - G_col))^T for an earlier sub-chunk (always complete): [BK, BC]."""
    m = m_k[None, :] & (o_c[:, None] >= 0)
    b_k = tl.load(k + o_c[:, None] * HK + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(G + o_c[:, None] * HK + o_k[None, :], mask=m, other=0.0)
    return tl.trans(b_k * tl.exp2(b_gn[None, :] - b_g))


@triton.jit
def _store_row(Aqk, Ai, o_c, m_c, o_i, HBT, b_q0, b_q1, b_q2, b_i0, b_i1, b_i2, b_i3,
               BC: tl.constexpr, R: tl.constexpr):
    """Row sub-chunk R: Aqk's R blocks left of the diagonal and zeros right of it (the diagonal block is
    intra_token's); Ainv's R + 1 blocks up to the diagonal and zeros right of it."""
    m = m_c[:, None] & (o_i[None, :] >= 0)
    p = o_c[:, None] * HBT + o_i[None, :]
    tl.store(Ai + p, b_i0.to(Ai.dtype.element_ty), mask=m)
    if R >= 1:
        tl.store(Aqk + p, b_q0.to(Aqk.dtype.element_ty), mask=m)
        tl.store(Ai + p + BC, b_i1.to(Ai.dtype.element_ty), mask=m)
    if R >= 2:
        tl.store(Aqk + p + BC, b_q1.to(Aqk.dtype.element_ty), mask=m)
        tl.store(Ai + p + 2 * BC, b_i2.to(Ai.dtype.element_ty), mask=m)
    if R >= 3:
        tl.store(Aqk + p + 2 * BC, b_q2.to(Aqk.dtype.element_ty), mask=m)
        tl.store(Ai + p + 3 * BC, b_i3.to(Ai.dtype.element_ty), mask=m)
    b_z = tl.zeros([BC, BC], dtype=tl.float32)
    for c in tl.static_range(R + 1, 4):
        tl.store(Aqk + p + c * BC, b_z.to(Aqk.dtype.element_ty), mask=m)
        tl.store(Ai + p + c * BC, b_z.to(Ai.dtype.element_ty), mask=m)


@triton.jit
def _inv_diag(Akd, o_c, m_c, o_i, HBC, INV_PREC: tl.constexpr):
    """(I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8) for a strictly lower 16x16 diagonal block N of Akk: six
    small dots and no serial chain (a row-by-row substitution is 15 dependent steps)."""
    b_m = -tl.load(Akd + o_c[:, None] * HBC + o_i[None, :], mask=m_c[:, None] & (o_i[None, :] >= 0), other=0.0)
    b_p = (o_i[:, None] == o_i[None, :]).to(tl.float32) + b_m
    b_m = tl.dot(b_m, b_m, input_precision=INV_PREC)
    b_p += tl.dot(b_p, b_m, input_precision=INV_PREC)
    b_m = tl.dot(b_m, b_m, input_precision=INV_PREC)
    b_p += tl.dot(b_p, b_m, input_precision=INV_PREC)
    b_m = tl.dot(b_m, b_m, input_precision=INV_PREC)
    return b_p + tl.dot(b_p, b_m, input_precision=INV_PREC)


@triton.autotune(configs=SOLVE_CONFIGS, key=["H", "K", "t_bucket"], **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=["t_bucket"])
def kda_inter_solve_kernel(q, k, G, beta, q_rstd, k_rstd, Akd, Aqk, Ai, cu_seqlens, chunk_indices, scale, t_bucket,
                           H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                           NORM_QK: tl.constexpr, DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr):
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_t, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
    base = (bos * H + i_h)
    q += base * K
    k += base * K
    G += base * K
    beta += base
    Akd += base * BC
    Aqk += base * BT
    Ai += base * BT
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
    b_b1 = tl.load(beta + o_c1 * H, mask=m_c1, other=0.0)
    b_b2 = tl.load(beta + o_c2 * H, mask=m_c2, other=0.0)
    b_b3 = tl.load(beta + o_c3 * H, mask=m_c3, other=0.0)
    b_k10 *= b_b1[:, None]
    b_k20 *= b_b2[:, None]
    b_k21 *= b_b2[:, None]
    b_k30 *= b_b3[:, None]
    b_k31 *= b_b3[:, None]
    b_k32 *= b_b3[:, None]

    HBC = H * BC
    if Ai.dtype.element_ty == tl.bfloat16:  # stored with 8 bits: DOT_PREC's error is far below that
        b_i00 = _inv_diag(Akd, o_c0, m_c0, o_i, HBC, DOT_PREC)
        b_i11 = _inv_diag(Akd, o_c1, m_c1, o_i, HBC, DOT_PREC)
        b_i22 = _inv_diag(Akd, o_c2, m_c2, o_i, HBC, DOT_PREC)
        b_i33 = _inv_diag(Akd, o_c3, m_c3, o_i, HBC, DOT_PREC)
    else:
        b_i00 = _inv_diag(Akd, o_c0, m_c0, o_i, HBC, INV_PREC)
        b_i11 = _inv_diag(Akd, o_c1, m_c1, o_i, HBC, INV_PREC)
        b_i22 = _inv_diag(Akd, o_c2, m_c2, o_i, HBC, INV_PREC)
        b_i33 = _inv_diag(Akd, o_c3, m_c3, o_i, HBC, INV_PREC)
    # X_ij = -X_ii * sum_{j <= m < i} A_im X_mj
    b_i10 = -tl.dot(b_i11, tl.dot(b_k10, b_i00, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_i21 = -tl.dot(b_i22, tl.dot(b_k21, b_i11, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_i20 = -tl.dot(b_i22, tl.dot(b_k20, b_i00, input_precision=DOT_PREC)
                    + tl.dot(b_k21, b_i10, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_i32 = -tl.dot(b_i33, tl.dot(b_k32, b_i22, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_i31 = -tl.dot(b_i33, tl.dot(b_k31, b_i11, input_precision=DOT_PREC)
                    + tl.dot(b_k32, b_i21, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_i30 = -tl.dot(b_i33, tl.dot(b_k30, b_i00, input_precision=DOT_PREC)
                    + tl.dot(b_k31, b_i10, input_precision=DOT_PREC)
                    + tl.dot(b_k32, b_i20, input_precision=DOT_PREC), input_precision=DOT_PREC)

    HBT = H * BT
    b_z = tl.zeros([BC, BC], dtype=tl.float32)
    _store_row(Aqk, Ai, o_c0, m_c0, o_i, HBT, b_z, b_z, b_z, b_i00, b_z, b_z, b_z, BC, 0)
    _store_row(Aqk, Ai, o_c1, m_c1, o_i, HBT, b_q10 * scale, b_z, b_z, b_i10, b_i11, b_z, b_z, BC, 1)
    _store_row(Aqk, Ai, o_c2, m_c2, o_i, HBT, b_q20 * scale, b_q21 * scale, b_z, b_i20, b_i21, b_i22, b_z, BC, 2)
    _store_row(Aqk, Ai, o_c3, m_c3, o_i, HBT, b_q30 * scale, b_q31 * scale, b_q32 * scale, b_i30, b_i31, b_i32,
               b_i33, BC, 3)


register("intra_token", Entry(kda_intra_token_kernel, TOKEN_PINNED))
register("inter_solve", Entry(kda_inter_solve_kernel, SOLVE_PINNED))


def chunk_intra(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, beta: torch.Tensor, scale: float,
                cu_seqlens: torch.Tensor | None = None, q_rstd: torch.Tensor | None = None,
                k_rstd: torch.Tensor | None = None, *, _layout=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Ainv, Aqk), each [B, T, H, 64] in k's dtype (like fla: half the bytes for the two kernels that read them),
    from q, k [B, T, H, K], fp32 cumsum G and beta [B, T, H] (any float dtype: read as fp32). With
    ``q_rstd``/``k_rstd`` (fp32 [B, T, H], from :func:`l2norm_rstd`) q and k count as L2-normalised."""
    L = _layout or layout(k, None, cu_seqlens)
    q = canonical("q", q, (L.B, L.T, L.H, L.K))
    k = canonical("k", k, (L.B, L.T, L.H, L.K))
    G = canonical("G", G, (L.B, L.T, L.H, L.K), (torch.float32,))
    beta = as_fp32("beta", beta, (L.B, L.T, L.H))
    q_rstd, k_rstd = check_rstd(q_rstd, k_rstd, L)
    Akd = torch.empty(L.B, L.T, L.H, BC, dtype=torch.float32, device=k.device)
    Aqk = torch.empty(L.B, L.T, L.H, BT, dtype=k.dtype, device=k.device)
    Ai = torch.empty_like(Aqk)
    kw = dict(H=L.H, K=L.K, BT=BT, BC=BC, NORM_QK=q_rstd is not None)
    dispatch("intra_token", lambda meta: (L.NT * (BT // meta["TB"]), cdiv(L.H, meta["BH"])),
             q, k, G, beta, q_rstd, k_rstd, Aqk, Akd, L.cu_seqlens, L.chunk_indices, float(scale), L.bucket,
             BK=next_pow2(L.K), **kw)
    dispatch("inter_solve", lambda meta: (L.NT, L.H), q, k, G, beta, q_rstd, k_rstd, Akd, Aqk, Ai, L.cu_seqlens,
             L.chunk_indices, float(scale), L.bucket, **kw)
    return Ai, Aqk
