"""The side streams of segmented and overlapped passes, and the overlapped pass's protocol
(csrc/overlap.cuh) on the host side. Only stream order here: what the CPU cannot check."""

from __future__ import annotations

import torch

from .layout import Kernel, Segment
from .placement import sync_words

WHOLE: Segment = (0, 0)
"""Every group of the batch at once."""


class Fork:
    """The streams of a pass: the device's chain stream and ``segments`` group streams start
    after the work queued so far on ``here`` (torch's current stream), and ``here`` goes on
    only after all of theirs (:meth:`join`), so that every buffer used on them goes back to
    torch's caching allocator ordered after that work."""

    def __init__(self, device, here, segments: int):
        self.here = here
        self.chain = device.chain_stream
        self.groups = device.group_streams[:segments]  # (no events on streams left idle)
        start = here.record_event()
        for stream in (self.chain, *self.groups):
            stream.wait_event(start)

    def group(self, i: int):
        return self.groups[i % len(self.groups)]

    def join(self) -> None:
        for stream in (self.chain, *self.groups):
            self.here.wait_event(stream.record_event())


def overlap_sync(n_chains: int, tickets: int, device: torch.device) -> torch.Tensor:
    """An overlapped pass's zeroed int32 sync buffer (:func:`~ttt_cupy.placement.sync_words`);
    made before the fork, so that its zeroing precedes both kernels."""
    return torch.zeros(sync_words(n_chains, tickets), dtype=torch.int32, device=device)


def run_overlapped(device, chain: Kernel, group: Kernel, sync: torch.Tensor, n_chains: int,
                   tickets: int, spins: int, fork: Fork) -> None:
    """The chain kernel on the fork's chain stream, the group kernel (mode kOverlap, one block
    per ticket) beside it on a group stream, then the join and, on ``here``, the cleanup launch
    (kCleanup) running the tickets that group blocks handed back. The group stream first waits
    until every chain block has started (``spins`` 0: not at all), so that group blocks never
    take the places the chain needs; where the GPU placed them first anyway, they hand their
    tickets back after ``spins`` naps."""
    chain.launch(device, n_chains, WHOLE, fork.chain, sync=sync)
    if spins > 0:
        device.wait_value(fork.group(0), sync.data_ptr(), n_chains)  # overlap::kStarted
    tail = dict(sync=sync, n_chains=n_chains, wait_spins=spins)
    group.launch(device, tickets, WHOLE, fork.group(0), mode=1, **tail)  # overlap::kOverlap
    fork.join()
    group.launch(device, tickets, WHOLE, fork.here, mode=2, **tail)      # overlap::kCleanup
