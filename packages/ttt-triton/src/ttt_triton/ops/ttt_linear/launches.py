"""A pass's kernel launches, compiled side by side the first time.

Every launch is ``kernel[grid](*args, **kwargs)``. Triton compiles a kernel specialisation
on its first launch, so a pass of two or three kernels (forward: the chain and the output
kernel; backward: the local, chain and gradient kernels) would compile them one after
another. Its compiler does most of that work outside the GIL (the MLIR and LLVM passes,
ptxas), so here a pass whose key has not been seen in this process compiles its kernels at
the same time: every kernel but the first through ``JITFunction.warmup`` (which compiles
what launching would, with the same arguments, and keeps it in Triton's caches) in a thread
each, while the first launches and compiles in the calling thread; then the rest launch,
finding theirs compiled. Later passes with the same key launch directly.

The threads only compile. Loading a compiled kernel (building and importing Triton's
launcher module for its signature, loading the binary onto the device) happens at its first
launch, in the calling thread: Triton does not promise that loading is safe in several
threads at once, and a launch that gets a launcher built for another kernel's signature
fails with "function takes exactly N arguments (M given)". Triton's driver is set up in the
calling thread before any thread starts, for the same reason.

A pass can also be compiled ahead (:func:`prefetch`): the launcher builds a later pass's
launches (the backward's, on a forward's first call) from placeholder tensors and their
kernels compile in background threads while the caller goes on; the first :func:`run` of
that kind waits for them, then finds them compiled.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ttt import Problem

from ..._env import kernels_interpreted

MAX_KEYS = 4096
"""Pass keys remembered; past this many the memory starts over (a pass then compiles in
threads again, finding its kernels compiled)."""

_SEEN: set[tuple] = set()

_AHEAD: dict[str, list[Future]] = {}
"""Per pass kind, the compiles :func:`prefetch` started that no :func:`run` waited for yet."""

_AHEAD_KEYS: set[tuple] = set()
"""The pass keys :func:`prefetch` took (each is compiled ahead once; at most
:data:`MAX_KEYS`, as ``_SEEN``)."""

AHEAD_THREADS = 4
"""Threads of the compiles ahead (a backward has at most three kernels)."""


@functools.cache
def _ahead_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(AHEAD_THREADS, thread_name_prefix="ttt-triton-prefetch")


@dataclass(slots=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **kwargs)``."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)

    def compile(self, device: torch.device, load: bool = False) -> None:
        """Compile (and keep, in Triton's caches) what launching would, without launching
        it; in any thread (the device is this thread's current one only inside). ``load``:
        also load it onto ``device``, so that a CUDA graph capture may launch it (loading a
        module is not allowed there)."""
        with torch.cuda.device(device):
            compiled = self.kernel.warmup(*self.args, grid=self.grid, **self.kwargs)
            if load:
                compiled[self.grid]


def prepare_triton() -> None:
    """Set up Triton's driver in the calling thread (once per process; later calls cost a
    lookup), before threads that compile use it."""
    from triton.runtime import driver

    driver.active.get_current_device()


def pass_key(kind: str, p: Problem, *flags) -> tuple:
    """What picks a pass's kernel specialisations, but the batch shape: the pass, head count
    and dim, chunk size, dtypes, the optional inputs present, the options, the device and
    the launcher's own ``flags``."""
    eta_key, h0, hb0 = p.eta_key, p.initial_state, p.initial_state_bias
    return (kind, p.H, p.D, p.chunk_size, p.q.dtype, p.w.dtype, p.b.dtype, p.eta.dtype,
            None if eta_key is None else eta_key.dtype, h0 is None, hb0 is None,
            p.output_final_state, p.is_varlen, p.output, p.q.device, *flags)


def wants_prefetch(kind: str, p: Problem, *flags) -> bool:
    """Whether a pass of this :func:`pass_key` is worth compiling ahead: on a GPU, neither
    run nor compiled ahead in this process."""
    return _new_ahead(pass_key(kind, p, *flags))


def _new_ahead(key: tuple) -> bool:
    return not kernels_interpreted() and key not in _SEEN and key not in _AHEAD_KEYS


def prefetch(launches: list[Launch], device: torch.device, kind: str, p: Problem,
             *flags) -> None:
    """Compile ``launches`` (a later pass's, :func:`pass_key` ``kind``, ``p``, ``flags``; their
    tensors placeholders of the dtypes the real ones have) in background threads, once per
    key, so that the first :func:`run` of ``kind`` finds them compiled. A compile that fails
    here is left to that run, which compiles and raises as it would have."""
    key = pass_key(kind, p, *flags)
    if not _new_ahead(key):
        return
    if len(_AHEAD_KEYS) >= MAX_KEYS:
        _AHEAD_KEYS.clear()
    _AHEAD_KEYS.add(key)
    prepare_triton()
    pool = _ahead_pool()
    _AHEAD.setdefault(kind, []).extend(pool.submit(_compile_quietly, launch, device)
                                       for launch in launches)


def _compile_quietly(launch: Launch, device: torch.device) -> None:
    try:
        launch.compile(device)
    except Exception:  # noqa: BLE001 - the pass's own run compiles it again and raises there
        pass


def _wait_for_prefetches(kind: str) -> None:
    for done in _AHEAD.pop(kind, ()):
        done.result()


def run(launches: list[Launch], device: torch.device, kind: str, p: Problem, *flags) -> None:
    """Launch ``launches`` in order, after the compiles ahead of passes of ``kind``
    (:func:`prefetch`); the first time their :func:`pass_key` comes (on a GPU, with more than
    one launch), compile them all at once first."""
    if kind in _AHEAD:
        _wait_for_prefetches(kind)
    key = None if len(launches) < 2 else pass_key(kind, p, *flags)
    if key is None or key in _SEEN or kernels_interpreted():
        for launch in launches:
            launch()
        return
    prepare_triton()
    with ThreadPoolExecutor(len(launches) - 1, thread_name_prefix="ttt-triton-compile") as pool:
        compiling = [pool.submit(launch.compile, device) for launch in launches[1:]]
        launches[0]()
        for done in compiling:
            done.result()
    for launch in launches[1:]:
        launch()
    if len(_SEEN) >= MAX_KEYS:
        _SEEN.clear()
    _SEEN.add(key)
