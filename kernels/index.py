"""Chunk indices for packed varlen batches, computed on the CPU from ``cu_seqlens`` (a small index tensor)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkIndex:
    """``indices``: [NT, 2] int32 (sequence, chunk within it); ``offsets``: [N + 1] int32 first chunk per sequence;
    ``longest_first``: [N] int32 the sequences by chunk count, most first (ties in batch order)."""

    indices: torch.Tensor
    offsets: torch.Tensor
    longest_first: torch.Tensor
    num_chunks: int


def validate_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """The sequence bounds as Python ints: the index is a few hundred entries at most, and plain Python builds it
    without torch's CPU ops (whose thread pool, spun up at a process's first call, costs 0.4 s when a node's ranks
    start together: measured by bench/offline_autotune.py --profile on the H200)."""
    if cu_seqlens.device.type == "meta":
        raise ValueError("cu_seqlens must hold real values (a CPU int32 tensor), not a meta tensor")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])) or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={total}; got {bounds[:8]}...")
    return bounds


def prepare_chunk_index(cu_seqlens: torch.Tensor, chunk_size: int, total: int) -> ChunkIndex:
    bounds = validate_cu_seqlens(cu_seqlens, total)
    pairs, offsets = [], [0]
    for seq, (a, b) in enumerate(zip(bounds, bounds[1:])):
        n = -(-(b - a) // chunk_size)
        pairs += [(seq, c) for c in range(n)]
        offsets.append(offsets[-1] + n)
    indices = torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2)
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    longest_first = sorted(range(len(counts)), key=lambda n: -counts[n])
    return ChunkIndex(indices, torch.tensor(offsets, dtype=torch.int32),
                      torch.tensor(longest_first, dtype=torch.int32), offsets[-1])
