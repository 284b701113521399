"""The schedule decisions every chunked GPU backend makes, in one vocabulary.

A backend that splits the op into a sequential *chain* kernel per (sequence, head) and
parallel kernels per group of chunks (both built-in GPU backends do) decides, per pass:

- **fuse or split**: whether the chain kernel also does the parallel kernels' work. Fusing
  puts that work on the chains' critical path, which pays only when enough chains run at
  once to hide it: :class:`FuseThresholds` names the chain counts, per backend (each
  measured its own), and :func:`fuse_forward` / :func:`fuse_backward` apply them;
- **the generation step**: a forward without a backward in which every sequence fits in
  one chunk (:func:`generation_step`, what a decode step of ``ttt.nn.TTTLinear`` makes) is
  fused whatever the chain count: one launch, since the parallel kernel would only replay
  the chain's one step after it;
- **the row step**: such a step of at most a backend's ``rows`` rows per sequence
  (:func:`row_step`) runs a kernel of its own that walks the rows one by one against the
  state instead of a padded chunk's tile products.

A backend's forced choices (its tests' and benchmarks' ``Tuning`` / ``Schedule``) come in as
``forced``: None lets the rule decide.
"""

from __future__ import annotations

from dataclasses import dataclass

from .problem import Problem


@dataclass(frozen=True)
class FuseThresholds:
    """(sequence, head) chains from which a backend fuses: the forward without a backward
    (``forward_inference``), the forward that saves for one (``forward_training``), the
    backward (``backward``)."""

    forward_inference: int
    forward_training: int
    backward: int


def chains(p: Problem) -> int:
    """The (sequence, head) chains of ``p``: one chain kernel program (or block) each."""
    return p.N * p.H


def generation_step(p: Problem, save_for_backward: bool) -> bool:
    """Whether ``p``'s forward is a generation step: no backward, and every sequence within
    one chunk (dense: ``T <= chunk_size``; packed: every length)."""
    return not save_for_backward and max(p.seq_lens, default=0) <= p.chunk_size


def fuse_forward(p: Problem, save_for_backward: bool, thresholds: FuseThresholds,
                 forced: bool | None = None) -> bool:
    """Whether the forward chain writes the outputs itself: ``forced`` if given, else for a
    :func:`generation_step`, else from ``thresholds``' chain count."""
    if forced is not None:
        return forced
    if generation_step(p, save_for_backward):
        return True
    least = thresholds.forward_training if save_for_backward else thresholds.forward_inference
    return chains(p) >= least


def fuse_backward(p: Problem, thresholds: FuseThresholds, forced: bool | None = None) -> bool:
    """Whether the backward chain does the parallel gradient kernel's work: ``forced`` if
    given, else from ``thresholds.backward`` chains (a backend checks first that its fused
    kernel exists for ``p``'s shape)."""
    if forced is not None:
        return forced
    return chains(p) >= thresholds.backward


def row_step(p: Problem, save_for_backward: bool, rows: int,
             forced_fuse: bool | None = None) -> bool:
    """Whether ``p``'s forward runs the row-step kernel alone: a :func:`generation_step` of
    at most ``rows`` rows per sequence, the fused chain not forced either way
    (``forced_fuse`` None: a forced choice runs the chained kernels)."""
    return (forced_fuse is None and generation_step(p, save_for_backward)
            and max(p.seq_lens, default=0) <= rows)
