"""Which schedule a pass runs: pure functions of the problem's shape (and a forced
:class:`~ttt_cupy.config.Schedule`). Every schedule gives bitwise the results of one launch
per kernel, except the fused chains and fwd_decode, which compute the same math in another
order.

- row step: a generation step of up to 16 rows per sequence runs fwd_decode alone, one launch
  (:func:`row_step`, :data:`ROW_STEP_ROWS`);
- fused: the chain kernel does the group kernel's work (many chains fill the GPU anyway; and
  a forward without a backward whose every sequence fits in one chunk, a generation step:
  one launch, see :func:`fused_forward`);
- overlapped: chain and group kernel at the same time, on per-group flags (few chains of
  several groups);
- segmented: the chain once per segment of whole groups, each segment's group kernels
  beside the chain's next segment (few long chains);
- plain: one launch per kernel, one after the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttt import Problem

from .compile import FUSED_BWD_MAX_D_PAD, d_pad
from .config import AUTO, Schedule
from .smem import bwd_chain_fused_smem_bytes, decode_rows, decode_smem_bytes

CKPT_INTERVAL = 16
"""G: chunks per group (a checkpoint slot every G chunks); the group kernels replay one group
each, so G trades slot memory against group-parallel work."""

FUSED = {"forward_inference": 128, "forward_training": 256, "backward": 256}
"""(sequence, head) chains from which the fused chains pay: fusing puts the group kernel's
work on the chains' critical path, which only a GPU full of chain blocks hides. A forward
without a backward whose sequences fit in one chunk fuses at any count (:func:`fused_forward`):
there the group kernel has no work of its own to run beside the chain."""

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
has finished its group, so with one group per sequence it waits for the whole chain and
the overlapped pass is the plain one plus its host work (a zeroed sync buffer, the fork's
events and stream waits, the cleanup launch)."""


@dataclass(frozen=True)
class Plan:
    """One pass's schedule: ``fuse`` (the fused chain), ``overlap``, and ``segments``, the
    group ranges [g_lo, g_hi) launched one after the other ([(0, 0)]: every group at once)."""

    fuse: bool
    overlap: bool
    segments: list[tuple[int, int]]


def chains(p: Problem) -> int:
    return p.N * p.H


def single_chunk(p: Problem) -> bool:
    """Whether every sequence fits in one chunk (dense: T <= chunk_size; packed: every length):
    a decode step, whose chain is one step and whose group kernel would replay that step."""
    return all(length <= p.chunk_size for length in p.seq_lens)


def fused_forward(p: Problem, save_for_backward: bool, schedule: Schedule = AUTO) -> bool:
    """Whether fwd_chain's fused instance writes the outputs (no fwd_out): from
    :data:`FUSED` chains, and for a forward without a backward whose every sequence fits in
    one chunk (:func:`single_chunk`) at any number of chains, so that a decode step is one
    launch (fwd_out would only replay the chain's one step, after it, for a second launch's
    host cost)."""
    if schedule.fuse_forward is not None:
        return schedule.fuse_forward
    if not save_for_backward and single_chunk(p):
        return True
    return chains(p) >= FUSED["forward_training" if save_for_backward else "forward_inference"]


ROW_STEP_ROWS = 16
"""The most rows of a sequence with which a generation step (no backward, every sequence
within one chunk: :func:`single_chunk`) runs fwd_decode alone (:func:`row_step`) instead of
fwd_chain's fused instance, for every input dtype and padded head dim: every step at chunk
16, and in a chunk of 32 or 64 those of up to 16 rows. From an H100 A/B of the two kernels
(``tools/row_step.py --backends cupy``: the layer's form, H 16, chunk 16, B 4 and 64, D 64
and 128, CUDA-graph replay), fwd_decode's time over the fused chain's at 1, 2, 4 and 16
rows:

======================  ============  ==========================================
inputs (q, k, v)        D_PAD         fwd_decode / fused chain (1 .. 16 rows)
======================  ============  ==========================================
bfloat16, float16       any           0.33 .. 0.98 (bf16 measured)
float32                 16 .. 64      0.24 .. 0.89
float32                 128           0.22 .. 0.46
======================  ============  ==========================================

fwd_decode reads and writes the state once and computes only the step's rows (each row a
row times the state, its work growing with the rows), where the fused chain runs a whole
padded chunk of tile products (tensor cores for half inputs) whatever the rows: fwd_decode
was the faster at every row count measured, least so at 16 rows (bf16 at B 64, D 64: 53 us
against 55), and the two kernels' results differed by at most 8.2e-4 (bf16) and 1.8e-7
(float32) of the norm. Steps of more than 16 rows (chunks of 32 and 64) are not measured,
so the fused chain keeps them (``Schedule(fuse_forward=True)`` forces it at any rows)."""


def row_step(p: Problem, save_for_backward: bool, smem_limit: int,
             schedule: Schedule = AUTO) -> bool:
    """Whether ``p``'s forward runs fwd_decode alone (one launch): a generation step (no
    backward, :func:`single_chunk`) whose every sequence has at most :data:`ROW_STEP_ROWS`
    rows, fwd_decode's block within ``smem_limit`` bytes of shared memory, and the fused
    chain not forced either way (``schedule.fuse_forward`` None: a forced Schedule runs the
    chained kernels, for tests and A/B timing)."""
    if schedule.fuse_forward is not None or save_for_backward or not single_chunk(p):
        return False
    longest = max(p.seq_lens, default=0)
    return (longest <= ROW_STEP_ROWS
            and decode_smem_bytes(d_pad(p.D), decode_rows(longest)) <= smem_limit)


def fused_backward(p: Problem, mma: bool, smem_limit: int, schedule: Schedule = AUTO) -> bool:
    """Whether the fused backward chain does bwd_grads' work: it exists for tensor-core
    kernels at D_PAD <= FUSED_BWD_MAX_D_PAD, within ``smem_limit`` bytes per block."""
    dp = d_pad(p.D)
    if not mma or dp > FUSED_BWD_MAX_D_PAD:
        return False
    if bwd_chain_fused_smem_bytes(dp, p.chunk_size) > smem_limit:
        return False
    if schedule.fuse_backward is not None:
        return schedule.fuse_backward
    return chains(p) >= FUSED["backward"]


def sync_words(n_chains: int, tickets: int) -> int:
    """int32 words of an overlapped pass's sync buffer (overlap.cuh): three counters, each
    chain's finished groups, room for every ticket."""
    return 3 + n_chains + tickets


def overlapped(p: Problem, fuse: bool, groups_max: int, backward: bool = False,
               tickets: int = 0, schedule: Schedule = AUTO) -> bool:
    """Whether the pass runs its chain and group kernel at the same time: the group kernel
    not fused away, its sync buffer within int32 counters, and (unless ``schedule.overlap``
    forces it) at most :data:`OVERLAP_MAX_CHAINS` chains with a sequence of at least
    :data:`OVERLAP_MIN_GROUPS` groups (``groups_max``)."""
    if fuse or schedule.overlap is False or sync_words(chains(p), tickets) >= 2**31:
        return False
    return schedule.overlap is True or (
        groups_max >= OVERLAP_MIN_GROUPS
        and chains(p) <= OVERLAP_MAX_CHAINS["backward" if backward else "forward"])


def segment_count(p: Problem, groups_max: int, backward: bool) -> int:
    """The rule's segments per pass (see :data:`SEGMENTS`, :data:`SEGMENT_MAX_CHAINS`,
    :data:`SEGMENT_MIN_GROUPS`)."""
    if chains(p) > SEGMENT_MAX_CHAINS:
        return 1
    least_groups, least_per_segment = SEGMENT_MIN_GROUPS[64 if p.D <= 64 else 128]
    if groups_max < least_groups:
        return 1
    segments = min(SEGMENTS, groups_max // least_per_segment)
    return max(2, segments // 2) if not backward and segments >= 2 else segments


def segment_plan(p: Problem, groups_max: int, backward: bool = True,
                 schedule: Schedule = AUTO) -> list[tuple[int, int]]:
    """The group ranges [g_lo, g_hi) of each sequence launched one after the other, sizes
    differing by at most one; [(0, 0)]: one launch per kernel over every group."""
    segments = schedule.segments or segment_count(p, groups_max, backward)
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
