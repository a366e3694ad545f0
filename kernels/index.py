"""Chunk indices for packed varlen batches, computed on the CPU from ``cu_seqlens`` (a small index tensor)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkIndex:
    """``indices``: [NT, 2] int32 (sequence, chunk within it); ``offsets``: [N + 1] int32 first chunk per sequence."""

    indices: torch.Tensor
    offsets: torch.Tensor
    num_chunks: int


def validate_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    if cu_seqlens.device.type == "meta":
        raise ValueError("cu_seqlens must hold real values (a CPU int32 tensor), not a meta tensor")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    cpu = cu_seqlens.detach().to("cpu", torch.int64)
    lens = cpu[1:] - cpu[:-1]
    if int(cpu[0]) != 0 or bool((lens < 0).any()) or int(cpu[-1]) != total:
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={total}; got {cpu.tolist()[:8]}...")
    return cpu


def prepare_chunk_index(cu_seqlens: torch.Tensor, chunk_size: int, total: int) -> ChunkIndex:
    cpu = validate_cu_seqlens(cu_seqlens, total)
    lens = cpu[1:] - cpu[:-1]
    n_chunks = (lens + chunk_size - 1) // chunk_size
    seq = torch.repeat_interleave(torch.arange(len(lens)), n_chunks)
    first = torch.cumsum(n_chunks, 0) - n_chunks
    local = torch.arange(int(n_chunks.sum())) - torch.repeat_interleave(first, n_chunks)
    indices = torch.stack([seq, local], 1).to(torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(n_chunks, 0)]).to(torch.int32)
    return ChunkIndex(indices, offsets, int(n_chunks.sum()))
