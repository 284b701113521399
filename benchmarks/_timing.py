"""Timing and peak-memory measurement: ``triton.testing.do_bench`` on CUDA, a wall clock on CPU.

Times are in milliseconds as ``(p20, p50, p80)``; the p50 (median) is the headline figure.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

QUANTILES = (0.2, 0.5, 0.8)
MAX_REP_MS = 5000.0   # never time one measurement for longer than this (plus warm-up)


@dataclass(frozen=True)
class Budget:
    """How long to warm up and to measure (ms), and the fewest timed calls wanted."""

    warmup_ms: float = 50.0
    rep_ms: float = 300.0
    min_iters: int = 10


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    ordered = sorted(times)
    if len(ordered) == 1:
        return ordered[0], ordered[0], ordered[0]
    cuts = statistics.quantiles(ordered, n=10, method="inclusive")  # deciles: 10%..90%
    return cuts[1], statistics.median(ordered), cuts[7]


def _first_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Calls ``fn`` untimed (compilation, autotuning outside every timed region), then once
    timed: that call's ms (at least 1e-3)."""
    fn()
    return max(_one_call_ms(fn, device), 1e-3)


def _call_for(fn: Callable[[], object], ms: float) -> None:
    """Calls ``fn`` for ``ms`` milliseconds (a warm-up)."""
    deadline = time.perf_counter() + ms / 1e3
    while time.perf_counter() < deadline:
        fn()


def _samples(take: Callable[[], float], ms: float, least: int) -> list[float]:
    """``take()``'s results for at least ``ms`` milliseconds and ``least`` samples (at most
    10,000)."""
    samples: list[float] = []
    deadline = time.perf_counter() + ms / 1e3
    while len(samples) < least or time.perf_counter() < deadline:
        samples.append(take())
        if len(samples) >= 10_000:
            break
    return samples


BATCH_MS = 2.0
"""About how long one sample of :func:`back_to_back` runs its calls."""


def back_to_back(fn: Callable[[], object], device: torch.device,
                 budget: Budget) -> tuple[float, float, float]:
    """``(p20, p50, p80)`` ms per call of ``fn`` called back to back, as a generation loop
    calls it: each sample is a batch of calls (about :data:`BATCH_MS`), timed from an idle
    device to the end of the last call's work, over the batch's size; the first call is
    untimed. The host's work and the device's overlap as in such a loop, so a host-bound
    call measures its host time and a device-bound one its device time. (:func:`bench`
    times each call alone after flushing the L2 cache, and the flush's kernel hides up to
    its own length of the host's work: no per-call time for a host-bound call.)"""
    calls = max(1, math.ceil(BATCH_MS / _first_call_ms(fn, device)))
    _call_for(fn, budget.warmup_ms)

    def batch_ms() -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        return (time.perf_counter() - start) * 1e3 / calls

    return _quantiles(_samples(batch_ms, min(budget.rep_ms, MAX_REP_MS), budget.min_iters))


def bench(fn: Callable[[], object], device: torch.device,
          budget: Budget) -> tuple[float, float, float]:
    """``(p20, p50, p80)`` ms of ``fn``; the first call (compilation, autotuning) is untimed."""
    estimate = _first_call_ms(fn, device)
    rep = min(max(budget.rep_ms, budget.min_iters * estimate), MAX_REP_MS)
    if device.type == "cuda":
        import triton.testing

        result = triton.testing.do_bench(fn, warmup=budget.warmup_ms, rep=rep,
                                         quantiles=list(QUANTILES), return_mode="median")
        if isinstance(result, (int, float)):
            return float(result), float(result), float(result)
        p20, p50, p80 = (float(x) for x in result)
        return p20, p50, p80
    # CPU (smoke test of the reporting path only): a plain wall clock.
    _call_for(fn, budget.warmup_ms)
    return _quantiles(_samples(lambda: _one_call_ms(fn, device), rep, budget.min_iters))


def peak_extra_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak device memory one call of ``fn`` allocates above what was live before (MiB).

    ``fn`` should return nothing that outlives it (its results are dropped at once). None
    on devices without allocator statistics (CPU).
    """
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return (peak - before) / 2**20
