"""Launchers: allocate outputs and work buffers with torch, launch the CUDA kernels through CuPy
(zero copy).

Kernels get raw ``data_ptr()`` addresses and run on torch's current stream of the inputs'
device; nothing is copied to the host. The split follows the Triton backend: the forward is
fwd_chain (one block per (sequence, head): the state chain, the checkpoint slots and the
LayerNorm's xhat [B, T, H, D] and r [B, T, H] of every row, fp32) then fwd_out (one block per
(group of G chunks, head): the outputs, g derived row-locally from xhat and r), or, with many
chains (:data:`FUSED`), fwd_chain's fused instance alone, writing the outputs itself; the
backward is bwd_local (per group), bwd_chain (per sequence, reverse) and bwd_grads (per group,
reverse; :func:`~ttt_cupy.compile.grads_split` blocks per group at D_PAD 128 with chunk 64),
all reading the saved xhat and r (no recomputed k W or LayerNorm); with many chains
(:func:`fused_backward`) the backward chain's fused instance does bwd_grads' work itself. With
few long chains (:func:`segment_plan`) each pass is split into segments of whole groups: the
chain kernel runs once per segment on a high-priority side stream, and a segment's
group-parallel kernels run on their own side streams as soon as it is done, beside the chain's
next segment (the backward: every bwd_local at once, then per segment bwd_chain, bwd_grads).
With few chains (:func:`overlapped`) the passes do not segment: fwd_chain and fwd_out, and
after bwd_local, bwd_chain and bwd_grads, run at the same time, the group kernel's blocks
waiting per group on flags the chain publishes (:func:`_overlapped`). Tunables live in
:data:`CKPT_INTERVAL`, :data:`FUSED` (``TTT_CUPY_FUSE=0/1`` forces the fused forward off / on),
:data:`SEGMENTS`, :data:`SEGMENT_MAX_CHAINS`, :data:`SEGMENT_MIN_GROUPS`
(``TTT_CUPY_SEGMENTS=K`` forces K segments) and :data:`OVERLAP_MAX_CHAINS`
(``TTT_CUPY_OVERLAP=0/1``). For half inputs all five kernels are their tensor-core (tf32
mma.sync) instances on sm_80+ unless ``TTT_CUPY_MMA=0`` is set (read at every launch by
:func:`ttt_cupy.compile.get_kernels`); float inputs always run SIMT fp32.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from ttt import Problem
from ttt.chunking import ChunkGroups, group_offsets

from .compile import (
    BLOCK_TS,
    FUSED_BWD_MAX_D_PAD,
    FUSED_BWD_NAME,
    FUSED_NAME,
    bwd_chain_fused_smem_bytes,
    d_pad,
    get_kernels,
    grads_split,
    kernels_use_mma,
    pass_smem,
    smem_bytes,
    threads,
)

CKPT_INTERVAL = 16
"""G: chunks per group. fwd_chain stores the fp32 state every G chunks (slots); the
group-parallel kernels replay one group each from its slot."""

FUSED = {"forward_inference": 128, "forward_training": 256, "backward": 256}
"""The fused forward: with at least this many (sequence, head) chains, fwd_chain's fused instance
writes the outputs itself and fwd_out is not launched; for a forward without backward
(``forward_inference``) it then stores no checkpoint slots, xhat or r either, with a backward
(``forward_training``) it stores them as the unfused forward does. Fusing puts fwd_out's work
on the chains' critical path, which pays only when enough chains run at once (the Triton
backend's ``FUSED`` has 96 for inference; on an H200, forward without backward, D 64, fused /
not: 0.535 / 0.459 ms at 8 x 2048 x 12 heads (96 chains), 0.601 / 0.692 ms at 12 x 2048 x 16
(192 chains)). :data:`FUSE_ENV` overrides the rule. ``backward``: the fused backward chain
(:func:`fused_backward`; bwd_grads' work in the chain, no bwd_grads); on an H200, D 64, fwd+bwd
fused / not: 2.06 / 1.91 ms at 128 chains, 2.70 / 2.69 at 192, 2.90 / 3.19 at 256, 4.71 / 4.71
at 384, 5.30 / 5.80 at 512 (two blocks per SM: 264 at once)."""

SEGMENTS = 16
"""The most launches per chain pass when segmented (:func:`segment_plan`); the forward takes
half as many as the backward. The forward has less GPU work per segment to cover its host
work: on an H200, forward without backward, one launch / 4 / 8 / 16 segments: 4 x 4096 x 8,
D 128 1.44 / 1.24 / 1.39 / 2.34 ms (8 segments: 1.39 ms of host time per call), 1 x 32768 x
16, D 64 4.36 / 4.12 / 4.05 / 4.11 ms."""

SEGMENT_MAX_CHAINS = 128
"""Segment the passes only with at most this many (sequence, head) chains: with fewer chains
than the GPU has SMs, the chain kernels leave most of it idle, and the group-parallel kernels
of finished segments fill it; with many chains the chain kernels fill it themselves."""

SEGMENT_MIN_GROUPS = {64: (16, 8), 128: (16, 2)}
"""By padded head dim (64: every D_PAD up to 64), (groups, groups per segment): segment only
sequences of at least that many groups (G chunks each), into segments of at least that many.
Each segment costs a few launches and events on the host, which a short segment's chain does
not cover. An H200, bf16, fwd / fwd+bwd ms, one launch against forced segments (one
process): 8 x 2048 x 12 heads, D 64 (8 groups) 0.457 / 1.60 against
0.752 / 2.03 (2); 4 x 4096 x 16, D 64 (16 groups) 0.724 / 2.46 against 0.670 / 2.37 (2),
0.898 / 2.76 (4); 1 x 32768 x 16, D 64 (128 groups) 4.34 / 12.3 against 4.05 (8) / 11.2
(16); 4 x 4096 x 8, D 128 (16 groups) 1.44 / 5.32 against 1.21 (2) / 4.74 (8). With
many chains it gains little: 32 x 2048 x 16 (512 chains) fwd+bwd 5.81 against 5.73 (2)."""

SEGMENT_ENV = "TTT_CUPY_SEGMENTS"
"""``TTT_CUPY_SEGMENTS=K`` forces K segments per pass (``1``: one launch per kernel; unset or
empty: :func:`segment_plan`'s rule); read at every call, for A/B runs."""

FUSE_ENV = "TTT_CUPY_FUSE"
"""``TTT_CUPY_FUSE=1`` forces the fused forward on, ``0`` off (unset or empty: :data:`FUSED`);
read at every call, for A/B runs of both paths."""

FUSE_GRADS_ENV = "TTT_CUPY_FUSE_GRADS"
"""``TTT_CUPY_FUSE_GRADS=1`` forces the fused backward chain (bwd_chain.cu's
``ttt_linear_bwd_chain_fused``: bwd_grads' work in the chain) on where it exists, ``0`` off
(unset or empty: :data:`FUSED`'s ``backward``); read at every call."""

OVERLAP_ENV = "TTT_CUPY_OVERLAP"
"""``TTT_CUPY_OVERLAP=0`` turns the overlapped passes (:func:`overlapped`) off, ``1`` on
wherever they can run (unset or empty: the rule); read at every call."""

OVERLAP_MAX_CHAINS = {"forward": 96, "backward": 32}
"""The overlapped passes run with at most this many (sequence, head) chains (and the group
kernel not fused away). With few chains most of the GPU idles beside them and the group
kernel's blocks use it; with more, those blocks share the chains' SMs and slow their steps.
On an H200, bf16, D 64 unless noted, overlapped / one launch or segments, one process (fwd /
fwd+bwd ms, both passes overlapped): 16 chains (1 x 32768 x
16) 3.64 / 10.6 against 3.89 / 11.1; 32 (4 x 4096 x 8, D 128) 1.19 / 4.04 against 1.45 /
4.67; 64 (4 x 4096 x 16) 0.641 / 2.40 against 0.659 / 2.31 (the backward slower); 96 (8 x
2048 x 12) 0.417 / 1.57 against 0.438 / 1.58."""

OVERLAP_SPINS_ENV = "TTT_CUPY_OVERLAP_SPINS"

OVERLAP_WAIT_SPINS = 256
"""How long (naps of about 0.25 us, ttt_common.cuh's ``nap``) a group block of an overlapped
pass waits for every chain block to have started before it puts its ticket back for the
cleanup launch. The group kernel's stream waits until they have (:func:`_stream_wait_value`),
so this only runs out without stream memory operations. :data:`OVERLAP_SPINS_ENV` ``0`` (tests)
drops that stream wait and puts back at once every ticket whose chains had not all started:
the fallback path, which then runs whenever the GPU places group blocks first."""

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).contiguous()


def max_smem_optin(device: torch.device) -> int | None:
    """The device's opt-in shared memory per block in bytes (None when torch does not say)."""
    return _max_smem_optin(_index(device))


@functools.cache
def _max_smem_optin(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    value = getattr(props, "shared_memory_per_block_optin", None)
    return int(value) if value else None


@functools.lru_cache(maxsize=1024)
def smem_reason(D: int, chunk_size: int, backward: bool, limit: int | None) -> str | None:
    """Why the kernels of this shape do not fit the device's shared memory (None: they do).
    Every shape fits an H100/H200 (227 KiB per block); an A100 (163 KiB) refuses head dims
    above 64 with a backward and at chunk size 64 without one. Cached (as the device query):
    the backend asks at every call, and uncached the two take about 0.12 ms of host time per
    forward (cProfile, 8 x 2048 x 12 x 64)."""
    if limit is None:
        return None
    dp = d_pad(D)
    passes = ("fwd", "bwd") if backward else ("fwd",)

    def fits(bt: int) -> bool:
        return all(pass_smem(pass_, dp, bt)[1] <= limit for pass_ in passes)

    for pass_ in passes:
        kernel, need = pass_smem(pass_, dp, chunk_size)
        if need > limit:
            what = "backward" if pass_ == "bwd" else "forward"
            smaller = [bt for bt in BLOCK_TS if bt < chunk_size and fits(bt)]
            hint = (f"chunk_size {max(smaller)} fits" if smaller
                    else f"no chunk_size fits head dim {D} here")
            return (f"the cupy {what} kernel {kernel} for head dim {D} (padded {dp}) and "
                    f"chunk_size {chunk_size} needs {need // 1024} KiB of shared memory; this "
                    f"device allows {limit // 1024} KiB per block ({hint})")
    return None


def _env_switch(name: str) -> bool | None:
    """The environment variable ``name`` as a forced switch: ``1`` True, ``0`` False, unset or
    empty None (the rule decides); anything else a ValueError naming it."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}: expected 0, 1 or unset, got {value!r}")
    return None if not value else value == "1"


def fused_forward(problem: Problem, save_for_backward: bool) -> bool:
    """Whether the forward runs fwd_chain's fused instance instead of fwd_chain + fwd_out
    (:data:`FUSED`, :data:`FUSE_ENV`)."""
    forced = _env_switch(FUSE_ENV)
    if forced is not None:
        return forced
    key = "forward_training" if save_for_backward else "forward_inference"
    return problem.N * problem.H >= FUSED[key]


def fused_backward(problem: Problem, mma: bool, index: int) -> bool:
    """Whether the backward runs the fused chain (no bwd_grads): tensor-core kernels, D_PAD <=
    :data:`~ttt_cupy.compile.FUSED_BWD_MAX_D_PAD`, its shared memory within the device's, and
    at least :data:`FUSED`'s ``backward`` chains (:data:`FUSE_GRADS_ENV` overrides the
    count)."""
    dp, bt = d_pad(problem.D), problem.chunk_size
    if not mma or dp > FUSED_BWD_MAX_D_PAD:
        return False
    if bwd_chain_fused_smem_bytes(dp, bt) > _device_smem_limit(index):
        return False
    forced = _env_switch(FUSE_GRADS_ENV)
    if forced is not None:
        return forced
    return problem.N * problem.H >= FUSED["backward"]


def overlapped(problem: Problem, fuse: bool, backward: bool = False, tickets: int = 0) -> bool:
    """Whether a pass runs its chain kernel and the group kernel that reads it at the same time
    (ttt_common.cuh's overlapped passes: fwd_chain and fwd_out, bwd_chain and bwd_grads; a
    group block starts on its group once the chain has finished it) instead of one after the
    other or in segments: where the group kernel runs (``fuse`` False) with at most
    :data:`OVERLAP_MAX_CHAINS`' chains for the pass, or wherever it runs with
    :data:`OVERLAP_ENV` ``1``; never with ``0``, when :data:`SEGMENT_ENV` forces segments, or
    when its ``tickets`` (group blocks) would not fit the int32 counters of ttt_common.cuh."""
    forced = _env_switch(OVERLAP_ENV)
    if fuse or forced is False or os.environ.get(SEGMENT_ENV, "").strip():
        return False
    if _sync_words(problem.N * problem.H, tickets) >= 2**31:
        return False
    limit = OVERLAP_MAX_CHAINS["backward" if backward else "forward"]
    return forced is True or problem.N * problem.H <= limit


def _overlap_wait_spins() -> int:
    """:data:`OVERLAP_WAIT_SPINS`, or :data:`OVERLAP_SPINS_ENV`'s value where set."""
    value = os.environ.get(OVERLAP_SPINS_ENV, "").strip()
    if not value:
        return OVERLAP_WAIT_SPINS
    if not value.isdigit():
        raise ValueError(f"{OVERLAP_SPINS_ENV}: expected a non-negative integer or unset, "
                         f"got {value!r}")
    return int(value)


def segment_plan(problem: Problem, groups_max: int,
                 backward: bool = True) -> list[tuple[int, int]]:
    """The group ranges [g_lo, g_hi) of each sequence that the passes launch one after the
    other; [(0, 0)]: one launch per kernel over every group.

    Segmented, a pass runs its chain kernel once per segment on a high-priority side stream
    (:func:`_chain_stream`; a segment starts from the state its predecessor left in the
    checkpoint slots) and the group-parallel kernels of a segment on a side stream of their
    own (:func:`_group_streams`) as soon as their segment's chain (or, for bwd_local,
    nothing) is done: they run beside the chain's next segment instead of after the whole
    chain. The arithmetic is the same either way (bitwise: tests/test_cpu_emulation.py).
    Rule: with at most :data:`SEGMENT_MAX_CHAINS` chains and sequences of at least
    :data:`SEGMENT_MIN_GROUPS`'s groups, up to :data:`SEGMENTS` segments of at least its
    groups per segment (sizes differ by at most one), half as many (at least 2) for the
    forward (``backward`` False); :data:`SEGMENT_ENV` overrides it for both."""
    value = os.environ.get(SEGMENT_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{SEGMENT_ENV}: expected a positive integer or unset, "
                             f"got {value!r}")
        segments = int(value)
    else:
        segments = SEGMENTS if problem.N * problem.H <= SEGMENT_MAX_CHAINS else 1
        least_groups, least_per_segment = SEGMENT_MIN_GROUPS[64 if problem.D <= 64 else 128]
        if groups_max < least_groups:
            segments = 1
        segments = min(segments, groups_max // least_per_segment)
        if not backward and segments >= 2:
            segments = max(2, segments // 2)
    segments = min(segments, groups_max)
    if segments < 2:
        return [(0, 0)]
    edges = [i * groups_max // segments for i in range(segments + 1)]  # sizes differ by <= 1
    return list(zip(edges[:-1], edges[1:]))


GROUP_STREAMS = 8
"""Side streams for the group-parallel kernels of segmented passes (round robin over the
segments): a segment's kernel has few blocks and each runs G chunks in order, so it takes
about one block's time whatever its size; on one stream the segments' kernels would queue
behind each other and take longer than the chain."""


@functools.cache
def _chain_stream(index: int) -> torch.cuda.Stream:
    """The side stream of device ``index`` that runs the chain kernels of segmented passes,
    at high priority: when a segment ends, the next one's blocks are placed before any
    waiting block of the group-parallel kernels."""
    return torch.cuda.Stream(device=index, priority=-1)  # torch: lower is higher, -1 high


@functools.cache
def _group_streams(index: int) -> tuple[torch.cuda.Stream, ...]:
    """:data:`GROUP_STREAMS` side streams of device ``index`` for the group-parallel kernels
    of segmented passes."""
    return tuple(torch.cuda.Stream(device=index) for _ in range(GROUP_STREAMS))


class _Fork:
    """The streams of a segmented pass of ``segments`` segments: the chain stream and the
    group streams it uses start after the work queued so far on torch's current stream
    ``here`` (:meth:`__init__`), and ``here`` goes on only after all of theirs (:meth:`join`),
    so every buffer used on them goes back to torch's caching allocator ordered after that
    work."""

    def __init__(self, here: torch.cuda.Stream, index: int, segments: int):
        self.here = here
        self.chain = _chain_stream(index)
        self.groups = _group_streams(index)[:segments]  # (no events on streams left idle)
        start = here.record_event()
        for stream in (self.chain, *self.groups):
            stream.wait_event(start)

    def group(self, i: int) -> torch.cuda.Stream:
        return self.groups[i % len(self.groups)]

    def join(self) -> None:
        for stream in (self.chain, *self.groups):
            self.here.wait_event(stream.record_event())


def _group_blocks(grp: ChunkGroups, N: int, segment: tuple[int, int]) -> int:
    """(group, head) blocks per head of a group-parallel launch over ``segment`` (group_coords:
    every group of the batch, or N sequences' groups g_lo .. g_hi - 1)."""
    g_lo, g_hi = segment
    return grp.count if g_hi <= g_lo else N * (g_hi - g_lo)


@dataclass
class Saved:
    """What the forward keeps for the backward: the fp32 state slots, the LayerNorm's xhat and
    r of every row (fwd_chain) and the grouping."""

    ck: torch.Tensor          # [slots, H, D, D] fp32
    ckb: torch.Tensor         # [slots, H, D] fp32
    xbuf: torch.Tensor        # [B, T, H, D] fp32 xhat
    rbuf: torch.Tensor        # [B, T, H] fp32 r
    groups: ChunkGroups
    f32: tuple                # eta, w, b as the kernels read them (fp32, contiguous)

    def tensors(self) -> list[torch.Tensor]:
        """The backend interface's ``saved``: the tensors, in :func:`saved_shapes`' order."""
        return [self.ck, self.ckb, self.xbuf, self.rbuf]

    @classmethod
    def of(cls, p: Problem, tensors: list[torch.Tensor]) -> Saved:
        """Back from :meth:`tensors`; the grouping derived from ``p``, eta, w, b cast again."""
        ck, ckb, xbuf, rbuf = tensors
        return cls(ck, ckb, xbuf, rbuf, ChunkGroups.of(p, CKPT_INTERVAL),
                   (_f32(p.eta), _f32(p.w), _f32(p.b)))


def saved_shapes(p: Problem) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of :meth:`Saved.tensors` of a forward of ``p`` with a backward."""
    slots = group_offsets(p, CKPT_INTERVAL)[-1] + p.N
    B, T, H, D = p.q.shape
    return [((slots, H, D, D), torch.float32), ((slots, H, D), torch.float32),
            ((B, T, H, D), torch.float32), ((B, T, H), torch.float32)]


@functools.cache
def _device_smem_limit(index: int) -> int:
    import cupy

    runtime = cupy.cuda.runtime
    attr = getattr(runtime, "cudaDevAttrMaxSharedMemoryPerBlockOptin", 97)  # CUDA's enum value
    return int(runtime.deviceGetAttribute(attr, index))


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._ptr)


@functools.lru_cache(maxsize=256)
def _cupy_stream(ptr: int, index: int):
    """CuPy's view of torch's stream ``ptr`` (kept per stream: a segmented pass launches on
    several streams, many times): ``Stream.from_external`` where CuPy has it (CuPy 14
    deprecates ``ExternalStream``), else ``ExternalStream``."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, index)


@functools.cache
def _function(kernel, index: int, smem: int):
    """``kernel``'s CUDA function on device ``index`` (CuPy's ``Function``, launched
    directly: a RawKernel call looks the device and its function up again every time), opted
    in to ``smem`` bytes of dynamic shared memory (above 48 KiB) once. Keyed by the kernel
    object: :func:`~ttt_cupy.compile.get_kernels` hands out the same ones at every call, so
    this holds one entry per (instance, device, size) ever launched."""
    import cupy

    with cupy.cuda.Device(index):
        limit = _device_smem_limit(index)
        if smem > limit:
            raise RuntimeError(f"the cupy kernel needs {smem} bytes of shared memory; the "
                               f"device allows {limit} per block")
        if kernel.max_dynamic_shared_size_bytes < smem:
            kernel.max_dynamic_shared_size_bytes = smem
        return kernel.kernel


def _launch(kernel, index: int, grid: int, block: int, smem: int, args: tuple,
            stream: torch.cuda.Stream) -> None:
    """Launch ``kernel`` on ``stream`` of device ``index`` (the caller holds that device
    current: :func:`_on_device`) with ``smem`` bytes of dynamic shared memory."""
    if grid == 0:
        return
    _function(kernel, index, smem)((grid,), (block,), args, shared_mem=smem,
                                   stream=_cupy_stream(stream.cuda_stream, index))


def _on_device(index: int):
    """CuPy's current device set to ``index`` for a pass's launches (a kernel's function
    belongs to its device's context)."""
    import cupy

    return cupy.cuda.Device(index)


def _check_dtype(q: torch.Tensor) -> str:
    if q.dtype not in _DTYPE_NAMES:
        raise TypeError(f"q: expected float32, float16 or bfloat16 for the cupy kernels, "
                        f"got {q.dtype}")
    return _DTYPE_NAMES[q.dtype]


_NO_SYNC = np.uint64(0)
"""fwd_chain's ``sync`` argument when not overlapped (null)."""

_PLAIN_GROUP = (_NO_SYNC, np.int32(0), np.int64(0), np.int32(0))
"""fwd_out's and bwd_grads' (sync, mode, n_chains, wait_spins) when not overlapped (mode
kPlain)."""


def _sync_words(chains: int, tickets: int) -> int:
    """int32 words of an overlapped pass's sync buffer (ttt_common.cuh): three counters, each
    chain's finished groups, room for every ticket (:func:`overlapped` keeps it below 2^31)."""
    return 3 + chains + tickets


def _overlap_sync(chains: int, tickets: int, device: torch.device) -> torch.Tensor:
    """An overlapped pass's zeroed sync buffer (:func:`_sync_words`)."""
    return torch.zeros(_sync_words(chains, tickets), dtype=torch.int32, device=device)


@functools.cache
def _cu_stream_wait_value32():
    """The driver's ``cuStreamWaitValue32`` (through ctypes: neither torch nor CuPy offers
    stream memory operations), or None where libcuda or the function is missing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(lib, "cuStreamWaitValue32",
                                                                  None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


def _stream_wait_value(stream, address: int, value: int) -> bool:
    """Make ``stream`` wait until the int32 at device ``address`` is at least ``value``
    (``CU_STREAM_WAIT_VALUE_GEQ``); False where the driver cannot (nothing enqueued)."""
    fn = _cu_stream_wait_value32()
    return fn is not None and fn(stream.cuda_stream, address, value, 0) == 0


def _overlapped(chain_kernel, group_kernel, index: int, sync: torch.Tensor, chains: int,
                tickets: int, chain_threads: int, group_threads: int, chain_smem: int,
                group_smem: int, chain_args: tuple, group_args: tuple, fork: _Fork) -> None:
    """An overlapped pass (ttt_common.cuh): the chain kernel on the fork's high-priority chain
    stream, the group kernel (kOverlap, one block per ticket) beside it on a group stream, both
    on the zeroed ``sync`` (:func:`_overlap_sync`, zeroed before the fork); then the fork's join
    and, on torch's stream, the cleanup launch (kCleanup), which runs the tickets that group
    blocks put back. The group kernel's stream first waits (:func:`_stream_wait_value`) until
    every chain block has started, so that its blocks never take the places the chain needs:
    where the GPU placed them first anyway (no stream memory operations), they put their
    tickets back and the cleanup runs them after the chain, one kernel after the other.
    ``chain_args`` / ``group_args``: the kernels' arguments up to the segment."""
    spins = np.int32(_overlap_wait_spins())
    whole = (np.int64(0), np.int64(0))   # the whole sequence (the group kernels: unused)
    _launch(chain_kernel, index, chains, chain_threads, chain_smem,
            (*chain_args, *whole, _ptr(sync), np.uint64(chain_smem)), fork.chain)
    if spins > 0:  # (0: tests of the fallback path, OVERLAP_WAIT_SPINS)
        _stream_wait_value(fork.group(0), sync.data_ptr(), chains)  # overlap::kStarted

    def group(mode: int, stream) -> None:  # overlap::kOverlap 1, kCleanup 2
        _launch(group_kernel, index, tickets, group_threads, group_smem,
                (*group_args, *whole, _ptr(sync), np.int32(mode), np.int64(chains), spins,
                 np.uint64(group_smem)), stream)

    group(1, fork.group(0))
    fork.join()
    group(2, fork.here)


def ttt_linear_fwd(problem: Problem, save_for_backward: bool):
    """Returns (o, ht, hbt, saved); ht/hbt None unless output_final_state, saved None unless
    save_for_backward."""
    p = problem
    q, k, v, w, b, eta, cu_seqlens = p.q, p.k, p.v, p.w, p.b, p.eta, p.cu_seqlens
    dtype_name = _check_dtype(q)
    B, T, H, D = q.shape
    N = p.N
    BT, dp = p.chunk_size, d_pad(D)
    dev = q.device
    grp = ChunkGroups.of(p, CKPT_INTERVAL)
    G = grp.G
    f32 = dict(dtype=torch.float32, device=dev)
    ht = hbt = None
    if p.output_final_state:
        ht = torch.empty(N, H, D, D, **f32)
        hbt = torch.empty(N, H, 1, D, **f32)
    fuse = fused_forward(p, save_for_backward)
    save = save_for_backward or not fuse     # fwd_out reads the slots and xhat, r
    ck = ckb = xbuf = rbuf = None
    if save:
        ck = torch.empty(grp.slots, H, D, D, **f32)
        ckb = torch.empty(grp.slots, H, D, **f32)
        xbuf = torch.empty(q.shape, **f32)   # xhat
        rbuf = torch.empty(B, T, H, **f32)   # r
    eta32, w32, b32 = _f32(eta), _f32(w), _f32(b)
    h0, hb0 = _f32(p.initial_state), _f32(p.initial_state_bias)
    index = _index(dev)
    kern = get_kernels("fwd", dtype_name, dp, BT, index)
    nt = threads(dp)
    o = torch.empty_like(q)

    mma = kernels_use_mma(dtype_name, index)
    tickets = N * H * grp.groups_max        # (overlapped: one fwd_out block per ticket)
    overlap = overlapped(p, fuse, tickets=tickets)
    plan = [(0, 0)] if fuse or overlap else segment_plan(p, grp.groups_max, backward=False)
    chain_smem = smem_bytes("fwd_chain", dp, BT, mma, fused=fuse)
    out_smem = smem_bytes("fwd_out", dp, BT, mma)
    here = torch.cuda.current_stream(dev)
    sync = _overlap_sync(N * H, tickets, dev) if overlap else None  # (zeroed before the fork)
    fork = _Fork(here, index, len(plan)) if len(plan) > 1 or overlap else None
    chain_stream = here if fork is None else fork.chain
    # the launches' arguments but the segment and the shared memory size, built once per pass
    chain_args = (_ptr(q), _ptr(k), _ptr(v), _ptr(eta32), _ptr(w32), _ptr(b32), _ptr(h0),
                  _ptr(hb0), _ptr(ht), _ptr(hbt), _ptr(ck), _ptr(ckb), _ptr(xbuf), _ptr(rbuf),
                  _ptr(o), _ptr(cu_seqlens), _ptr(grp.offsets), np.float32(p.scale),
                  np.float32(p.eps), np.int64(T), np.int32(H), np.int32(D), np.int32(G))
    out_args = (_ptr(q), _ptr(k), _ptr(v), _ptr(eta32), _ptr(w32), _ptr(b32), _ptr(ck),
                _ptr(ckb), _ptr(xbuf), _ptr(rbuf), _ptr(o), _ptr(cu_seqlens), _ptr(grp.offsets),
                _ptr(grp.seq), np.float32(p.scale), np.float32(p.eps), np.int64(T),
                np.int32(H), np.int32(D), np.int32(G))
    with _on_device(index):
        if overlap:
            _overlapped(kern["fwd_chain"], kern["fwd_out"], index, sync, N * H, tickets,
                        threads(dp, "fwd_chain", mma), nt, chain_smem, out_smem, chain_args,
                        out_args, fork)
            plan, fork = [], None  # (joined)
        for i, (g_lo, g_hi) in enumerate(plan):
            seg = (np.int64(g_lo), np.int64(g_hi))
            _launch(kern[FUSED_NAME if fuse else "fwd_chain"], index, N * H,
                    threads(dp, "fwd_chain", mma), chain_smem,
                    (*chain_args, *seg, _NO_SYNC, np.uint64(chain_smem)), chain_stream)
            if fuse:
                break
            # this segment's outputs, beside the chain's next segment
            out_stream = here
            if fork is not None:
                out_stream = fork.group(i)
                out_stream.wait_event(chain_stream.record_event())
            _launch(kern["fwd_out"], index, _group_blocks(grp, N, (g_lo, g_hi)) * H, nt,
                    out_smem, (*out_args, *seg, *_PLAIN_GROUP, np.uint64(out_smem)), out_stream)
    if fork is not None:
        fork.join()
    saved = Saved(ck, ckb, xbuf, rbuf, grp, (eta32, w32, b32)) if save_for_backward else None
    return o, ht, hbt, saved


def ttt_linear_bwd(problem: Problem, saved: Saved, do, dht, dhbt):
    """Returns (dq, dk, dv, dw, db, deta, dh0, dhb0); dw/db [H, D] fp32, deta [B, T, H, 1]
    fp32, dh0/dhb0 None without initial states."""
    p = problem
    q, k, v, cu_seqlens = p.q, p.k, p.v, p.cu_seqlens
    want_dh0 = p.initial_state is not None or p.initial_state_bias is not None
    if saved is None:
        raise RuntimeError("the cupy backward needs the checkpoint slots of a forward run "
                           "with needs_backward=True")
    dtype_name = _check_dtype(q)
    B, T, H, D = q.shape
    N = p.N
    BT, dp = p.chunk_size, d_pad(D)
    grp = saved.groups
    G = grp.G
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    do = do.contiguous()
    eta32, w32, b32 = saved.f32              # (the forward's casts)
    dht, dhbt = _f32(dht), _f32(dhbt)
    index = _index(dev)
    kern = get_kernels("bwd", dtype_name, dp, BT, index)
    nt = threads(dp)

    xbuf, rbuf = saved.xbuf, saved.rbuf      # xhat, r (fwd_chain)
    dopbuf = torch.empty(q.shape, **f32)     # do_pre
    dgbuf = torch.empty(q.shape, **f32)      # dg_loc, then the full dg
    dq = torch.empty_like(q)
    deta = torch.empty(B, T, H, 1, **f32)
    mma = kernels_use_mma(dtype_name, index)
    fuse = fused_backward(p, mma, index)
    dwbp = torch.empty(2, 2, grp.count, H, D, **f32)  # per-group partials of dw, db
    dwp, dbp = dwbp[0], dwbp[1]              # [0]: bwd_local's, [1]: bwd_grads' (or the fused
    #                                          chain's)
    dh0 = dhb0 = None
    if want_dh0:
        dh0 = torch.empty(N, H, D, D, **f32)
        dhb0 = torch.empty(N, H, 1, D, **f32)
    dck = torch.empty_like(saved.ck)         # the slots' cotangents (bwd_chain -> bwd_grads)
    dckb = torch.empty_like(saved.ckb)       # (of hb: a segment's start, bwd_chain only)
    dk = torch.empty_like(q)
    dv = torch.empty_like(q)
    local_smem = smem_bytes("bwd_local", dp, BT, mma)
    chain_smem = bwd_chain_fused_smem_bytes(dp, BT) if fuse else smem_bytes("bwd_chain", dp,
                                                                               BT, mma)
    grads_smem = smem_bytes("bwd_grads", dp, BT)
    split_rows = grads_split(dp, BT)

    # the launches' arguments but the segment and the shared memory size, built once per pass
    # (the fused chain's: also the slots, dk, dv and the per-group dw, db partials)
    fused_args = ((_ptr(saved.ck), _ptr(dk), _ptr(dv), _ptr(dwp[1]), _ptr(dbp[1]))
                  if fuse else ())
    local_args = (_ptr(q), _ptr(k), _ptr(v), _ptr(eta32), _ptr(w32), _ptr(b32), _ptr(do),
                  _ptr(saved.ck), _ptr(saved.ckb), _ptr(xbuf), _ptr(rbuf), _ptr(dopbuf),
                  _ptr(dgbuf), _ptr(dq), _ptr(deta), _ptr(dwp[0]), _ptr(dbp[0]),
                  _ptr(cu_seqlens), _ptr(grp.offsets), _ptr(grp.seq), np.float32(p.scale),
                  np.float32(p.eps), np.int64(T), np.int32(H), np.int32(D), np.int32(G))
    chain_args = (_ptr(q), _ptr(k), _ptr(v), _ptr(eta32), _ptr(w32), _ptr(b32), _ptr(xbuf),
                  _ptr(rbuf), _ptr(dopbuf), _ptr(dgbuf), _ptr(deta), _ptr(dht), _ptr(dhbt),
                  _ptr(dck), _ptr(dckb), _ptr(dh0), _ptr(dhb0), *fused_args,
                  _ptr(cu_seqlens), _ptr(grp.offsets), np.float32(p.scale), np.int64(T),
                  np.int32(H), np.int32(D), np.int32(G))
    grads_args = () if fuse else (
        _ptr(q), _ptr(k), _ptr(v), _ptr(eta32), _ptr(w32), _ptr(b32), _ptr(saved.ck), _ptr(dck),
        _ptr(xbuf), _ptr(rbuf), _ptr(dopbuf), _ptr(dgbuf), _ptr(dk), _ptr(dv), _ptr(dwp[1]),
        _ptr(dbp[1]), _ptr(cu_seqlens), _ptr(grp.offsets), _ptr(grp.seq), np.float32(p.scale),
        np.int64(T), np.int32(H), np.int32(D), np.int32(G))

    def local(seg, stream):
        _launch(kern["bwd_local"], index, _group_blocks(grp, N, seg) * H, nt, local_smem,
                (*local_args, np.int64(seg[0]), np.int64(seg[1]), np.uint64(local_smem)),
                stream)

    def chain(seg, stream):  # fused: also dk, dv and the per-group dw, db partials
        _launch(kern[FUSED_BWD_NAME if fuse else "bwd_chain"], index, N * H,
                threads(dp, "bwd_chain", mma), chain_smem,
                (*chain_args, np.int64(seg[0]), np.int64(seg[1]),
                 *([] if fuse else [_NO_SYNC]), np.uint64(chain_smem)), stream)

    def grads(seg, stream):  # grads_split blocks per (group, head), each a part of W's rows
        _launch(kern["bwd_grads"], index, _group_blocks(grp, N, seg) * H * split_rows, nt,
                grads_smem,
                (*grads_args, np.int64(seg[0]), np.int64(seg[1]), *_PLAIN_GROUP,
                 np.uint64(grads_smem)), stream)

    tickets = N * H * grp.groups_max * split_rows  # (overlapped: a bwd_grads block each)
    overlap = overlapped(p, fuse, backward=True, tickets=tickets)
    plan = [(0, 0)] if overlap else segment_plan(p, grp.groups_max)
    here = torch.cuda.current_stream(dev)
    with _on_device(index):
        if overlap:  # bwd_local, then bwd_chain and bwd_grads at once (one block per ticket)
            local(plan[0], here)
            sync = _overlap_sync(N * H, tickets, dev)  # (zeroed before the fork)
            _overlapped(kern["bwd_chain"], kern["bwd_grads"], index, sync, N * H, tickets,
                        threads(dp, "bwd_chain", mma), nt, chain_smem, grads_smem,
                        chain_args, grads_args, _Fork(here, index, 1))
        elif len(plan) == 1:
            local(plan[0], here)
            chain(plan[0], here)
            if not fuse:
                grads(plan[0], here)
        else:
            # segments last to first. bwd_local needs no chain: every segment's goes out at
            # once, each on a group stream; the chain (its own stream) takes a segment once
            # that segment's bwd_local is done, and bwd_grads (the same group stream) follows
            # the chain
            fork = _Fork(here, index, len(plan))
            order = list(reversed(plan))
            local_done = []
            for i, seg in enumerate(order):
                local(seg, fork.group(i))
                local_done.append(fork.group(i).record_event())
            for i, seg in enumerate(order):
                fork.chain.wait_event(local_done[i])
                chain(seg, fork.chain)
                if not fuse:
                    fork.group(i).wait_event(fork.chain.record_event())
                    grads(seg, fork.group(i))
            fork.join()
    dw, db = dwbp.sum((1, 2)).unbind(0)       # (one reduction for both)
    return dq, dk, dv, dw, db, deta, dh0, dhb0
