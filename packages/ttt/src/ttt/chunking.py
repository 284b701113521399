"""How a batch splits into groups of chunks (one fp32 state checkpoint per group of ``G``
chunks): bookkeeping shared by the kernel backends, not part of the backend interface."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .problem import Problem


def group_offsets(p: Problem, chunks_per_group: int) -> list[int]:
    """``[N + 1]`` offsets over the batch of each sequence's first group."""
    return [0, *itertools.accumulate(-(-chunks // chunks_per_group)
                                     for chunks in p.chunk_counts())]


def _dense_groups(p: Problem, chunks_per_group: int) -> int | None:
    """Groups in each sequence of a dense batch; None for a packed batch."""
    if p.is_varlen:
        return None
    chunks = -(-p.T // p.chunk_size)
    return -(-chunks // chunks_per_group)


def group_count(p: Problem, chunks_per_group: int) -> int:
    """``group_offsets(...)[-1]``, without a loop over a dense batch's sequences."""
    per_sequence = _dense_groups(p, chunks_per_group)
    if per_sequence is not None:
        return p.B * per_sequence
    return group_offsets(p, chunks_per_group)[-1]


@dataclass
class ChunkGroups:
    """Every sequence owns NG + 1 slots (NG: its groups of ``G`` chunks): slot s < NG the
    state before chunk s * G, slot NG the final state."""

    G: int
    count: int                          # groups over the batch
    slots: int                          # checkpoint slots: count + N
    offsets: torch.Tensor | None        # [N + 1] int64 first group per sequence (varlen)
    seq: torch.Tensor | None            # [count] int32 sequence of each group (varlen)
    groups_max: int = 0                 # the most groups of one sequence

    @classmethod
    def of(cls, p: Problem, G: int,
           device_maps: tuple[torch.Tensor, torch.Tensor] | None = None) -> ChunkGroups:
        """The grouping of ``p``; for varlen, offsets and the group -> sequence map copied to
        ``p``'s device (non-blocking), unless ``device_maps`` holds them already."""
        per_sequence = _dense_groups(p, G)
        if per_sequence is not None:        # (no per-sequence bookkeeping to build)
            count = p.B * per_sequence
            return cls(G, count, count + p.B, None, None, per_sequence if p.B else 0)
        offs = group_offsets(p, G)
        counts = [b - a for a, b in zip(offs[:-1], offs[1:])]   # groups per sequence
        if device_maps is not None:
            offsets, seq = device_maps
        else:
            offsets = torch.tensor(offs, dtype=torch.int64).to(p.device, non_blocking=True)
            seq = torch.repeat_interleave(torch.arange(p.N, dtype=torch.int32),
                                          torch.tensor(counts)).to(p.device, non_blocking=True)
        return cls(G, offs[-1], offs[-1] + p.N, offsets, seq, max(counts, default=0))
