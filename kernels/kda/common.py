"""Helpers shared by the chunked KDA kernels: chunk position for fixed/varlen batches and input checks."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..index import ChunkIndex, prepare_chunk_index

# Autotune results on disk (`<fn>.autotune.json` in TRITON_CACHE_DIR) so a prewarmed node never autotunes.
# triton 3.2 (triton-ascend) has no such option; on Ascend the kernels run with pinned configs anyway.
AUTOTUNE_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

BT = 64  # chunk size
BC = 16  # sub-chunk size of the intra-chunk kernels
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def chunk_bounds(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
    """(chunk index within its sequence, first token, sequence length) in int64."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_b * T
    return i_t, bos, T


@dataclass(frozen=True)
class Layout:
    """Shapes of one chunked call: B, T, H, K, V, number of chunks (grid) and the varlen index if any."""

    B: int
    T: int
    H: int
    K: int
    V: int
    NT: int
    index: ChunkIndex | None
    cu_seqlens: torch.Tensor | None  # on the tensors' device
    chunk_indices: torch.Tensor | None  # on the tensors' device
    chunk_offsets: torch.Tensor | None  # on the tensors' device

    @property
    def num_seqs(self) -> int:
        return self.B if self.index is None else len(self.index.offsets) - 1


def layout(k: torch.Tensor, v: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> Layout:
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, K] (token-major), got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    V = v.shape[-1] if v is not None else K
    if cu_seqlens is None:
        return Layout(B, T, H, K, V, triton.cdiv(T, BT), None, None, None, None)
    if B != 1:
        raise ValueError(f"varlen (cu_seqlens given) needs B == 1 with sequences packed along T, got B={B}")
    idx = prepare_chunk_index(cu_seqlens, BT, T)
    # non_blocking: a blocking host-to-device copy waits for the stream to drain, leaving the GPU idle while the
    # following launches are issued
    dev = k.device
    return Layout(B, T, H, K, V, idx.num_chunks, idx, cu_seqlens.to(dev, torch.int32, non_blocking=True),
                  idx.indices.to(dev, non_blocking=True), idx.offsets.to(dev, non_blocking=True))


def check(name: str, t: torch.Tensor, shape: tuple, dtypes=FLOAT_DTYPES) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not supported (expected one of {[str(d) for d in dtypes]})")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (token-major layout)")


def check_rstd(q_rstd: torch.Tensor | None, k_rstd: torch.Tensor | None, L: Layout) -> bool:
    """Both L2-norm factors or neither; True when given."""
    if (q_rstd is None) != (k_rstd is None):
        raise ValueError("pass both q_rstd and k_rstd (from l2norm_rstd) or neither")
    if q_rstd is None:
        return False
    check("q_rstd", q_rstd, (L.B, L.T, L.H), (torch.float32,))
    check("k_rstd", k_rstd, (L.B, L.T, L.H), (torch.float32,))
    return True
