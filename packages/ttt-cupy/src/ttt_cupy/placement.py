"""Which schedule a pass runs: pure functions of the problem's shape (and a forced
:class:`~ttt_cupy.config.Schedule`). The decisions both GPU backends share (fuse or split, the
generation step, the row step) are :mod:`ttt.schedule`'s rules with this backend's numbers
(:data:`FUSED`, :data:`ROW_STEP_ROWS`); overlap and segments are this backend's own. Every
schedule gives bitwise the results of one launch per kernel, except the fused chains and
fwd_decode, which compute the same math in another order.

- row step: a generation step of up to 16 rows per sequence runs fwd_decode alone;
- fused: the chain kernel does the group kernel's work (many chains fill the GPU anyway; and
  every generation step: one launch);
- overlapped: chain and group kernel at the same time, on per-group flags (few chains of
  several groups);
- segmented: the chain once per segment of whole groups, each segment's group kernels
  beside the chain's next segment (few long chains);
- plain: one launch per kernel, one after the other.
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
"""G: chunks per group (a checkpoint slot every G chunks); the group kernels replay one group
each, so G trades slot memory against group-parallel work."""

FUSED = FuseThresholds(forward_inference=128, forward_training=256, backward=256)
"""(sequence, head) chains from which the fused chains pay: fusing puts the group kernel's
work on the chains' critical path, which only a GPU full of chain blocks hides."""

ROW_STEP_ROWS = 16
"""The most rows of a sequence with which a generation step runs fwd_decode alone
(:func:`row_step`) instead of fwd_chain's fused instance, for every input dtype and padded
head dim. From an H100 A/B of the two kernels (``tools/row_step.py --backends cupy``: the
layer's form, H 16, chunk 16, B 4 and 64, D 64 and 128, CUDA-graph replay), fwd_decode's time
over the fused chain's at 1, 2, 4 and 16 rows:

======================  ============  ==========================================
inputs (q, k, v)        D_PAD         fwd_decode / fused chain (1 .. 16 rows)
======================  ============  ==========================================
bfloat16, float16       any           0.33 .. 0.98 (bf16 measured)
float32                 16 .. 64      0.24 .. 0.89
float32                 128           0.22 .. 0.46
======================  ============  ==========================================

fwd_decode reads and writes the state once and computes only the step's rows, where the fused
chain runs a whole padded chunk of tile products whatever the rows: fwd_decode was the faster
at every row count measured, least so at 16 rows (bf16 at B 64, D 64: 53 us against 55), and
the two kernels' results differed by at most 8.2e-4 (bf16) and 1.8e-7 (float32) of the norm.
Steps of more than 16 rows (chunks of 32 and 64) are not measured, so the fused chain keeps
them (``Schedule(fuse_forward=True)`` forces it at any rows)."""

SEGMENTS = 16
"""The most segments per backward pass (the forward takes half as many, at least 2): each
segment costs host launches that more segments no longer cover."""

SEGMENT_MAX_CHAINS = 128
"""Segment only up to this many chains: with more, the chains fill the GPU themselves."""

SEGMENT_MIN_GROUPS = {64: (16, 8), 128: (16, 2)}
"""By padded head dim (64: every D_PAD up to 64): (groups a sequence needs to be segmented,
least groups per segment); a shorter segment's chain does not cover its host work."""

OVERLAP_MAX_CHAINS = {"forward": 96, "backward": 32}
"""Overlap only up to this many chains: with more, the group blocks share the chains' SMs and
slow their steps."""

OVERLAP_MIN_GROUPS = 2
"""Overlap only sequences of at least this many groups: a group block starts when its chain
has finished its group, so with one group per sequence it waits for the whole chain and the
overlapped pass is the plain one plus its host work."""


@dataclass(frozen=True)
class Plan:
    """One pass's schedule: ``fuse`` (the fused chain), ``overlap``, and ``segments``, the
    group ranges [g_lo, g_hi) launched one after the other ([(0, 0)]: every group at once)."""

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
    """Whether the fused backward chain does bwd_grads' work: it exists for tensor-core
    kernels at D_PAD <= FUSED_BWD_MAX_D_PAD, within ``smem_limit`` bytes per block."""
    dp = d_pad(p.D)
    if not mma or dp > FUSED_BWD_MAX_D_PAD or \
            bwd_chain_fused_smem_bytes(dp, p.chunk_size) > smem_limit:
        return False
    return shared.fuse_backward(p, FUSED, schedule.fuse_backward)


def sync_words(n_chains: int, tickets: int) -> int:
    """int32 words of an overlapped pass's sync buffer (overlap.cuh): three counters, each
    chain's finished groups, room for every ticket."""
    return 3 + n_chains + tickets


def overlapped(p: Problem, fuse: bool, groups_max: int, backward: bool = False,
               tickets: int = 0, schedule: Schedule = AUTO) -> bool:
    """Whether the pass runs its chain and group kernel at the same time: the group kernel
    not fused away, its sync buffer within int32 counters, and (unless forced) at most
    :data:`OVERLAP_MAX_CHAINS` chains with a sequence of :data:`OVERLAP_MIN_GROUPS` groups."""
    if fuse or schedule.overlap is False or sync_words(chains(p), tickets) >= 2**31:
        return False
    return schedule.overlap is True or (
        groups_max >= OVERLAP_MIN_GROUPS
        and chains(p) <= OVERLAP_MAX_CHAINS["backward" if backward else "forward"])


def segment_plan(p: Problem, groups_max: int, backward: bool = True,
                 schedule: Schedule = AUTO) -> list[tuple[int, int]]:
    """The group ranges [g_lo, g_hi) of each sequence launched one after the other, sizes
    differing by at most one; [(0, 0)]: one launch per kernel over every group."""
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
