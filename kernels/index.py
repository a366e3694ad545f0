"""Chunk indices for packed varlen batches, computed on the CPU from ``cu_seqlens`` (a small index tensor)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 4  # int32s: each field of the packed index starts 16-byte aligned (Triton specializes pointers on % 16)


@dataclass(frozen=True)
class ChunkIndex:
    """Every field an int32 view into ``packed``, so that one host-to-device copy moves the whole index (each copy
    costs ~0.8 us of GPU time: four of them were 1.5% of a 6k-token prefill on the H200): ``cu_seqlens`` [N + 1];
    ``indices`` [NT, 2] (sequence, chunk within it); ``offsets`` [N + 1] first chunk per sequence; ``longest_first``
    [N] the sequences by chunk count, most first (ties in batch order)."""

    packed: torch.Tensor
    cu_seqlens: torch.Tensor
    indices: torch.Tensor
    offsets: torch.Tensor
    longest_first: torch.Tensor
    num_chunks: int

    @classmethod
    def of(cls, packed: torch.Tensor, num_seqs: int, num_chunks: int) -> ChunkIndex:
        views, at = [], 0
        for n in (num_seqs + 1, 2 * num_chunks, num_seqs + 1, num_seqs):
            views.append(packed[at:at + n])
            at += -(-n // _ALIGN) * _ALIGN
        cu, indices, offsets, order = views
        return cls(packed, cu, indices.view(num_chunks, 2), offsets, order, num_chunks)

    def to(self, device: torch.device) -> ChunkIndex:
        """The same index on ``device``, in one copy (non-blocking: a blocking one waits for the stream to drain,
        leaving the GPU idle while the following launches are issued)."""
        return ChunkIndex.of(self.packed.to(device, non_blocking=True), len(self.longest_first), self.num_chunks)


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
        pairs += [x for c in range(n) for x in (seq, c)]
        offsets.append(offsets[-1] + n)
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    longest_first = sorted(range(len(counts)), key=lambda n: -counts[n])
    packed = []
    for field in (bounds, pairs, offsets, longest_first):
        packed += field + [0] * (-len(field) % _ALIGN)
    return ChunkIndex.of(torch.tensor(packed, dtype=torch.int32), len(counts), offsets[-1])
