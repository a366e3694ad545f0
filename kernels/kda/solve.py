"""(I + Akk)^-1 per 64-token chunk, fp32: forward substitution on the four 16x16 diagonal blocks, then the
off-diagonal blocks of the inverse by block products (exact in fp32 with ieee dots)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import AUTOTUNE_CACHE, BC, BT, canonical, chunk_bounds, layout

CONFIGS = [triton.Config({}, num_warps=num_warps, num_stages=2) for num_warps in [1, 2, 4]]
PINNED = {"num_warps": 4, "num_stages": 3}


@triton.jit
def _inv_diag(A, i_r, T, o_i, HBT, BC: tl.constexpr):
    """Inverse of the unit lower-triangular diagonal block starting at row i_r (rows >= T stay identity)."""
    m_c = (i_r + o_i) < T
    p = (i_r + o_i)[:, None] * HBT + (i_r % 64 + o_i)[None, :]
    b_a = tl.load(A + p, mask=m_c[:, None] & (o_i[None, :] >= 0), other=0.0)
    b_ai = -tl.where(o_i[:, None] > o_i[None, :], b_a, 0.0)
    for i in range(2, BC):
        b_r = -tl.load(A + (i_r + i) * HBT + i_r % 64 + o_i, mask=(o_i >= 0) & (i_r + i < T), other=0.0)
        b_r = tl.where(o_i < i, b_r, 0.0)
        b_r += tl.sum(b_r[:, None] * b_ai, 0)
        b_ai = tl.where((o_i == i)[:, None], b_r[None, :], b_ai)
    return b_ai + (o_i[:, None] == o_i[None, :]).to(tl.float32)


@triton.jit
def _blk(A, i_r, c, T, o_i, HBT, BC: tl.constexpr):
    m_c = (i_r + o_i) < T
    return tl.load(A + (i_r + o_i)[:, None] * HBT + (c * BC + o_i)[None, :],
                   mask=m_c[:, None] & (o_i[None, :] >= 0), other=0.0)


@triton.jit
def _put(Ai, b, i_r, c, T, o_i, HBT, BC: tl.constexpr):
    m_c = (i_r + o_i) < T
    tl.store(Ai + (i_r + o_i)[:, None] * HBT + (c * BC + o_i)[None, :], b, mask=m_c[:, None] & (o_i[None, :] >= 0))


@triton.autotune(configs=CONFIGS, key=["H"], **AUTOTUNE_CACHE)
@triton.jit
def kda_solve_kernel(A, Ai, cu_seqlens, chunk_indices, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_t, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
    A += (bos * H + i_h) * BT
    Ai += (bos * H + i_h) * BT
    HBT = H * BT
    o_i = tl.arange(0, BC)
    r0 = i_t * BT
    r1, r2, r3 = r0 + BC, r0 + 2 * BC, r0 + 3 * BC
    b_i00 = _inv_diag(A, r0, T, o_i, HBT, BC)
    b_i11 = _inv_diag(A, r1, T, o_i, HBT, BC)
    b_i22 = _inv_diag(A, r2, T, o_i, HBT, BC)
    b_i33 = _inv_diag(A, r3, T, o_i, HBT, BC)
    b_a10 = _blk(A, r1, 0, T, o_i, HBT, BC)
    b_a20 = _blk(A, r2, 0, T, o_i, HBT, BC)
    b_a21 = _blk(A, r2, 1, T, o_i, HBT, BC)
    b_a30 = _blk(A, r3, 0, T, o_i, HBT, BC)
    b_a31 = _blk(A, r3, 1, T, o_i, HBT, BC)
    b_a32 = _blk(A, r3, 2, T, o_i, HBT, BC)
    # X_ij = -X_ii * sum_{j <= m < i} A_im X_mj
    b_i10 = -tl.dot(b_i11, tl.dot(b_a10, b_i00, input_precision="ieee"), input_precision="ieee")
    b_i21 = -tl.dot(b_i22, tl.dot(b_a21, b_i11, input_precision="ieee"), input_precision="ieee")
    b_i20 = -tl.dot(b_i22, tl.dot(b_a20, b_i00, input_precision="ieee")
                    + tl.dot(b_a21, b_i10, input_precision="ieee"), input_precision="ieee")
    b_i32 = -tl.dot(b_i33, tl.dot(b_a32, b_i22, input_precision="ieee"), input_precision="ieee")
    b_i31 = -tl.dot(b_i33, tl.dot(b_a31, b_i11, input_precision="ieee")
                    + tl.dot(b_a32, b_i21, input_precision="ieee"), input_precision="ieee")
    b_i30 = -tl.dot(b_i33, tl.dot(b_a30, b_i00, input_precision="ieee")
                    + tl.dot(b_a31, b_i10, input_precision="ieee")
                    + tl.dot(b_a32, b_i20, input_precision="ieee"), input_precision="ieee")
    b_z = tl.zeros([BC, BC], dtype=tl.float32)
    _put(Ai, b_i00, r0, 0, T, o_i, HBT, BC)
    _put(Ai, b_z, r0, 1, T, o_i, HBT, BC)
    _put(Ai, b_z, r0, 2, T, o_i, HBT, BC)
    _put(Ai, b_z, r0, 3, T, o_i, HBT, BC)
    _put(Ai, b_i10, r1, 0, T, o_i, HBT, BC)
    _put(Ai, b_i11, r1, 1, T, o_i, HBT, BC)
    _put(Ai, b_z, r1, 2, T, o_i, HBT, BC)
    _put(Ai, b_z, r1, 3, T, o_i, HBT, BC)
    _put(Ai, b_i20, r2, 0, T, o_i, HBT, BC)
    _put(Ai, b_i21, r2, 1, T, o_i, HBT, BC)
    _put(Ai, b_i22, r2, 2, T, o_i, HBT, BC)
    _put(Ai, b_z, r2, 3, T, o_i, HBT, BC)
    _put(Ai, b_i30, r3, 0, T, o_i, HBT, BC)
    _put(Ai, b_i31, r3, 1, T, o_i, HBT, BC)
    _put(Ai, b_i32, r3, 2, T, o_i, HBT, BC)
    _put(Ai, b_i33, r3, 3, T, o_i, HBT, BC)


register("solve", Entry(kda_solve_kernel, PINNED))


def chunk_solve(Akk: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, _layout=None) -> torch.Tensor:
    """(I + Akk)^-1 per chunk: [B, T, H, 64] fp32 in, same shape out (zero above the diagonal)."""
    L = _layout or layout(Akk, None, cu_seqlens)
    Akk = canonical("Akk", Akk, (L.B, L.T, L.H, BT), (torch.float32,))
    Ai = torch.empty_like(Akk)
    dispatch("solve", lambda meta: (L.NT, L.H), Akk, Ai, L.cu_seqlens, L.chunk_indices, H=L.H, BT=BT, BC=BC)
    return Ai
