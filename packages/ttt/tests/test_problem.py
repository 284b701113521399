"""Chunk bookkeeping: chunk counts, group offsets and ChunkGroups."""

from __future__ import annotations

import torch

from ttt.chunking import ChunkGroups, group_offsets
from ttt.problem import Problem


def _problem(T: int, seq_lens: tuple[int, ...], varlen: bool, chunk: int = 16) -> Problem:
    B = 1 if varlen else len(seq_lens)
    x = torch.randn(B, T, 2, 8)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()]) if varlen else None
    return Problem(q=x, k=x, v=x, w=torch.ones(2, 8), b=torch.zeros(2, 8),
                   eta=torch.full((B, T, 2, 1), 0.1), scale=1.0, eps=1e-6, chunk_size=chunk,
                   initial_state=None, initial_state_bias=None, output_final_state=False,
                   cu_seqlens=cu, seq_lens=seq_lens, eta_is_tensor=True)


def test_dense_groups():
    p = _problem(100, (100, 100, 100), varlen=False)   # 7 chunks each
    assert p.chunk_counts() == [7, 7, 7]
    assert group_offsets(p, 4) == [0, 2, 4, 6]
    grp = ChunkGroups.of(p, 4)
    assert (grp.G, grp.count, grp.slots) == (4, 6, 9)
    assert grp.offsets is None and grp.seq is None


def test_varlen_groups():
    p = _problem(90, (1, 64, 25), varlen=True)          # 1, 4 and 2 chunks
    assert p.chunk_counts() == [1, 4, 2]
    assert group_offsets(p, 3) == [0, 1, 3, 4]
    grp = ChunkGroups.of(p, 3)
    assert (grp.count, grp.slots) == (4, 7)
    assert grp.offsets.tolist() == [0, 1, 3, 4]
    assert grp.offsets.dtype == torch.int64
    assert grp.seq.tolist() == [0, 1, 1, 2]
    assert grp.seq.dtype == torch.int32
