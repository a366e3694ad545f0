"""Reciprocal L2 norm per row (token, head) of q or k: rstd = 1 / sqrt(sum x^2 + 1e-6), fp32 [B, T, H].

The chunk kernels apply it where they load q / k (or to the bilinear A blocks), so normalised q / k are never
rounded to bf16 and never written back: about a quarter of the bf16 error budget of o, and two tensor rewrites.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import Entry, dispatch, register
from .common import AUTOTUNE_CACHE, FLOAT_DTYPES, canonical, cdiv, next_pow2, token_bucket

CONFIGS = [triton.Config({"BR": BR}, num_warps=num_warps) for BR in [16, 64] for num_warps in [2, 4]]
PINNED = {"BR": 16, "num_warps": 4, "num_stages": 3}


@triton.autotune(configs=CONFIGS, key=["D", "t_bucket"], **AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=["R", "t_bucket"])
def kda_l2norm_kernel(x, rstd, R, t_bucket, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < R)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + o_r[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(rstd + o_r, 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6), mask=o_r < R)


register("l2norm", Entry(kda_l2norm_kernel, PINNED))


def l2norm_rstd(x: torch.Tensor) -> torch.Tensor:
    """fp32 [*x.shape[:-1]]: 1 / sqrt(sum over the last dim of x^2 + 1e-6); x any float dtype, views copied. For
    x [..., H, D] the autotune token bucket is that of its leading dims' tokens (a chunked call's B * T), for x [R, D]
    that of its R rows."""
    x = canonical("l2norm input", x, tuple(x.shape), FLOAT_DTYPES)
    D = x.shape[-1]
    R = x.numel() // D
    tokens = R // x.shape[-2] if x.dim() >= 3 and x.shape[-2] else R
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    dispatch("l2norm", lambda meta: (cdiv(R, meta["BR"]),), x, rstd, R, token_bucket(tokens), D=D, BD=next_pow2(D))
    return rstd
