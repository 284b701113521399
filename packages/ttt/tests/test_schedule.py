"""The schedule vocabulary both GPU backends decide with (``ttt.schedule``)."""

from __future__ import annotations

import torch

import ttt
from ttt import schedule
from ttt.schedule import FuseThresholds

THRESHOLDS = FuseThresholds(forward_inference=8, forward_training=16, backward=12)


def _problem(B=1, T=16, H=2, chunk=16, lens=None):
    q = torch.randn(B, T, H, 8)
    cu = None if lens is None else torch.tensor([0, *lens]).cumsum(0)
    return ttt.make_problem(q, q, q, torch.ones(H, 8), torch.zeros(H, 8), 0.1,
                            chunk_size=chunk, cu_seqlens=cu)


def test_a_generation_step_is_a_forward_without_backward_within_one_chunk():
    assert schedule.generation_step(_problem(T=16), False)
    assert not schedule.generation_step(_problem(T=16), True)
    assert not schedule.generation_step(_problem(T=17), False)
    assert schedule.generation_step(_problem(T=17, chunk=32), False)
    assert schedule.generation_step(_problem(T=20, lens=(16, 0, 4)), False)
    assert not schedule.generation_step(_problem(T=20, lens=(3, 17)), False)


def test_fusing_follows_the_chain_count_and_the_forced_choice():
    few, many = _problem(B=3, T=40, H=2), _problem(B=8, T=40, H=2)      # 6 and 16 chains
    assert schedule.chains(many) == 16
    assert not schedule.fuse_forward(few, False, THRESHOLDS)
    assert schedule.fuse_forward(many, False, THRESHOLDS)
    assert schedule.fuse_forward(many, True, THRESHOLDS)
    assert not schedule.fuse_forward(_problem(B=7, T=40, H=2), True, THRESHOLDS)
    assert schedule.fuse_forward(_problem(B=1, T=5), False, THRESHOLDS)  # a generation step
    assert not schedule.fuse_forward(_problem(B=1, T=5), False, THRESHOLDS, forced=False)
    assert schedule.fuse_forward(few, True, THRESHOLDS, forced=True)
    assert schedule.fuse_backward(many, THRESHOLDS)
    assert not schedule.fuse_backward(few, THRESHOLDS)
    assert not schedule.fuse_backward(many, THRESHOLDS, forced=False)


def test_a_row_step_is_a_short_generation_step_not_forced():
    assert schedule.row_step(_problem(T=4), False, rows=4)
    assert not schedule.row_step(_problem(T=5), False, rows=4)
    assert not schedule.row_step(_problem(T=4), True, rows=4)
    assert not schedule.row_step(_problem(T=4), False, rows=4, forced_fuse=True)
    assert not schedule.row_step(_problem(T=4), False, rows=4, forced_fuse=False)
