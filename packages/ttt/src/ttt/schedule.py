"""The schedule decisions every chunked GPU backend makes, in one vocabulary: per pass,
whether a (sequence, head) *chain* kernel fuses the parallel kernels' work
(:class:`FuseThresholds`, measured per backend), which a generation step always does, and
whether such a step of few rows runs the row-step kernel. ``forced`` (a backend's tests' and
benchmarks' ``Tuning`` / ``Schedule``): None lets the rule decide.
"""

from __future__ import annotations

from dataclasses import dataclass

from .problem import Problem


@dataclass(frozen=True)
class FuseThresholds:
    """(sequence, head) chains from which a backend fuses each pass."""

    forward_inference: int
    forward_training: int
    backward: int


def chains(p: Problem) -> int:
    """The (sequence, head) chains of ``p``: one chain kernel program each."""
    return p.N * p.H


def generation_step(p: Problem, save_for_backward: bool) -> bool:
    """No backward, and every sequence within one chunk."""
    return not save_for_backward and max(p.seq_lens, default=0) <= p.chunk_size


def fuse_forward(p: Problem, save_for_backward: bool, thresholds: FuseThresholds,
                 forced: bool | None = None) -> bool:
    """Whether the forward chain writes the outputs itself."""
    if forced is not None:
        return forced
    if generation_step(p, save_for_backward):
        return True
    least = thresholds.forward_training if save_for_backward else thresholds.forward_inference
    return chains(p) >= least


def fuse_backward(p: Problem, thresholds: FuseThresholds, forced: bool | None = None) -> bool:
    """Whether the backward chain does the parallel gradient kernel's work (a backend checks
    first that its fused kernel exists for ``p``'s shape)."""
    return forced if forced is not None else chains(p) >= thresholds.backward


def row_step(p: Problem, save_for_backward: bool, rows: int,
             forced_fuse: bool | None = None) -> bool:
    """Whether ``p``'s forward runs the row-step kernel alone: a :func:`generation_step` of
    at most ``rows`` rows per sequence, fusing not forced either way."""
    return (forced_fuse is None and generation_step(p, save_for_backward)
            and max(p.seq_lens, default=0) <= rows)
