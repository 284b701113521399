"""Which schedule a pass runs: pure functions of the problem's shape (and a forced
:class:`~ttt_cupy.config.Schedule`). The rules both GPU backends share are :mod:`ttt.schedule`'s
with this backend's numbers (:data:`FUSED`, :data:`ROW_STEP_ROWS`); overlap and segments are
its own. Every schedule gives bitwise the results of one launch per kernel, but the fused
chains and fwd_decode (the same math in another order).

- row step: fwd_decode alone for a generation step of up to 16 rows per sequence;
- fused: the chain does the group kernel's work (many chains; every generation step);
- overlapped: chain and group kernel at once, on per-group flags (few chains, several groups);
- segmented: the chain per segment of groups, each segment's group kernels beside the next;
- plain: one launch per kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttt import Problem
from ttt import schedule as shared
from ttt.schedule import FuseThresholds, chains

from .compile import FUSED_BWD_MAX_D_PAD, d_pad
from .config import AUTO, Schedule
from .smem import bwd_chain_fused_smem_bytes, decode_rows, decode_smem_bytes

CKPT_INTERVAL = 16
"""G: chunks per group (a checkpoint slot each): slot memory against group-parallel work."""

FUSED = FuseThresholds(forward_inference=128, forward_training=256, backward=256)
"""(sequence, head) chains from which the fused chains pay (a GPU full of chain blocks hides
the group kernel's work on the chains' critical path)."""

ROW_STEP_ROWS = 16
"""The most rows of a sequence with which a generation step runs fwd_decode alone
(:func:`row_step`) instead of fwd_chain's fused instance, for every dtype and head dim: on an
H100 (``tools/row_step.py --backends cupy``) fwd_decode took 0.22-0.98x the fused chain's
time at 1 to 16 rows (the README's row step); more rows are not measured."""

SEGMENTS = 16
"""The most segments per backward pass (the forward: half as many, at least 2); each costs
host launches."""

SEGMENT_MAX_CHAINS = 128
"""Segment only up to this many chains: with more, the chains fill the GPU themselves."""

SEGMENT_MIN_GROUPS = {64: (16, 8), 128: (16, 2)}
"""By padded head dim (64: up to 64): (groups a sequence needs to be segmented, least groups
per segment)."""

OVERLAP_MAX_CHAINS = {"forward": 96, "backward": 32}
"""Overlap only up to this many chains (more: group blocks slow the chains' SMs)."""

OVERLAP_MIN_GROUPS = 2
"""Overlap only sequences of at least this many groups (with one, a group block waits for the
whole chain)."""


@dataclass(frozen=True)
class Plan:
    """One pass's schedule; ``segments``: the group ranges [g_lo, g_hi) launched one after the
    other ([(0, 0)]: every group at once)."""

    fuse: bool
    overlap: bool
    segments: list[tuple[int, int]]


def row_step(p: Problem, save_for_backward: bool, smem_limit: int,
             schedule: Schedule = AUTO) -> bool:
    """Whether ``p``'s forward runs fwd_decode alone: ``ttt.schedule.row_step`` with
    :data:`ROW_STEP_ROWS`, and fwd_decode's block within ``smem_limit`` bytes."""
    if not shared.row_step(p, save_for_backward, ROW_STEP_ROWS, schedule.fuse_forward):
        return False
    return decode_smem_bytes(d_pad(p.D), decode_rows(max(p.seq_lens, default=0))) <= smem_limit


def fused_forward(p: Problem, save_for_backward: bool, schedule: Schedule = AUTO) -> bool:
    """Whether fwd_chain's fused instance writes the outputs (no fwd_out)."""
    return shared.fuse_forward(p, save_for_backward, FUSED, schedule.fuse_forward)


def fused_backward(p: Problem, mma: bool, smem_limit: int, schedule: Schedule = AUTO) -> bool:
    """Whether the fused backward chain does bwd_grads' work (MMA, D_PAD <= FUSED_BWD_MAX_D_PAD,
    within ``smem_limit`` bytes)."""
    dp = d_pad(p.D)
    if not mma or dp > FUSED_BWD_MAX_D_PAD or \
            bwd_chain_fused_smem_bytes(dp, p.chunk_size) > smem_limit:
        return False
    return shared.fuse_backward(p, FUSED, schedule.fuse_backward)


def sync_words(n_chains: int, tickets: int) -> int:
    """int32 words of an overlapped pass's sync buffer (overlap.cuh)."""
    return 3 + n_chains + tickets


def overlapped(p: Problem, fuse: bool, groups_max: int, backward: bool = False,
               tickets: int = 0, schedule: Schedule = AUTO) -> bool:
    """Whether the pass runs its chain and group kernel at once: not fused, the sync buffer
    within int32, and (unless forced) the OVERLAP_* bounds."""
    if fuse or schedule.overlap is False or sync_words(chains(p), tickets) >= 2**31:
        return False
    return schedule.overlap is True or (
        groups_max >= OVERLAP_MIN_GROUPS
        and chains(p) <= OVERLAP_MAX_CHAINS["backward" if backward else "forward"])


def segment_plan(p: Problem, groups_max: int, backward: bool = True,
                 schedule: Schedule = AUTO) -> list[tuple[int, int]]:
    """The group ranges [g_lo, g_hi) launched one after the other, sizes differing by at most
    one; [(0, 0)]: one launch over every group."""
    segments = schedule.segments
    if not segments:
        least_groups, per_segment = SEGMENT_MIN_GROUPS[64 if p.D <= 64 else 128]
        segments = 1
        if chains(p) <= SEGMENT_MAX_CHAINS and groups_max >= least_groups:
            segments = min(SEGMENTS, groups_max // per_segment)
            if not backward and segments >= 2:
                segments = max(2, segments // 2)
    segments = min(segments, groups_max)
    if segments < 2:
        return [(0, 0)]
    edges = [i * groups_max // segments for i in range(segments + 1)]
    return list(zip(edges[:-1], edges[1:]))


def forward_plan(p: Problem, groups_max: int, save_for_backward: bool,
                 schedule: Schedule = AUTO) -> Plan:
    fuse = fused_forward(p, save_for_backward, schedule)
    overlap = overlapped(p, fuse, groups_max, tickets=chains(p) * groups_max,
                         schedule=schedule)
    segments = [(0, 0)] if fuse or overlap else segment_plan(p, groups_max, False, schedule)
    return Plan(fuse, overlap, segments)


def backward_plan(p: Problem, groups_max: int, split_rows: int, mma: bool, smem_limit: int,
                  schedule: Schedule = AUTO) -> Plan:
    fuse = fused_backward(p, mma, smem_limit, schedule)
    tickets = chains(p) * groups_max * split_rows
    overlap = overlapped(p, fuse, groups_max, backward=True, tickets=tickets,
                         schedule=schedule)
    segments = [(0, 0)] if overlap else segment_plan(p, groups_max, True, schedule)
    return Plan(fuse, overlap, segments)
