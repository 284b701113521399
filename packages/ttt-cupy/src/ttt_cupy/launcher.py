"""The forward and backward passes: torch buffers, kernels launched through CuPy on torch's
current stream (zero copy), in the schedule :mod:`ttt_cupy.placement` picks, on the side
streams it needs. Every tensor returned is a new one. A dense batch's setup (grouping, plan,
kernels, block and shared memory sizes) is kept per configuration, so a repeated call only
allocates and launches. ``device`` (default: the inputs'
:class:`~ttt_cupy.device.CudaDevice`) is the one seam to the GPU: tests pass a stand-in that
records the launches or runs them in the CPU emulation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ttt import Gradients, GradNeeds, Problem
from ttt.chunking import ChunkGroups

from .compile import CTYPES, DECODE_KERNEL, DECODE_PASS, FUSED_BWD_NAME, FUSED_NAME, d_pad
from .config import AUTO, Schedule, config
from .device import cuda_device
from .layout import Saved, f32
from .params import BwdParams, DecodeParams, FwdParams, Params
from .placement import CKPT_INTERVAL, Plan, backward_plan, forward_plan, row_step, sync_words
from .smem import (
    bwd_chain_fused_smem_bytes,
    decode_rows,
    decode_smem_bytes,
    decode_threads,
    grads_split,
    smem_bytes,
    threads,
)

Segment = tuple[int, int]   # groups [g_lo, g_hi) of each sequence; WHOLE: every group
WHOLE: Segment = (0, 0)

MAX_SETUPS = 64
"""Setups kept per pass (dense batches); past this many they are all made again."""


_DTYPE_NAMES = {getattr(torch, name): name for name in CTYPES}


def _dtype_name(q: torch.Tensor) -> str:
    name = _DTYPE_NAMES.get(q.dtype)
    if name is None:
        raise TypeError(f"q: expected float32, float16 or bfloat16 for the cupy kernels, "
                        f"got {q.dtype}")
    return name


def _variant(p: Problem) -> dict:
    """``p``'s variant as keyword arguments of ``device.kernels``."""
    return dict(key=p.eta_key is not None, out=p.output)


def _setup_key(p: Problem, device, *options) -> tuple | None:
    """A dense batch's setup key; None for a packed batch (its grouping holds device tensors)."""
    return None if p.is_varlen else (
        device, p.q.shape, p.q.dtype, p.chunk_size, p.output, p.eta_key is not None, p.scale,
        p.eps, *options, config().mma)


def _keep(setups: dict, key: tuple | None, setup) -> None:
    """Keep ``setup`` under ``key`` (None: not kept); all forgotten past MAX_SETUPS."""
    if key is not None:
        if len(setups) >= MAX_SETUPS:
            setups.clear()
        setups[key] = setup


@dataclass(frozen=True)
class Kernel:
    """A kernel of a pass with its block, shared memory and argument struct."""

    fn: Any
    block: int
    smem: int
    params: Params

    def launch(self, device, grid: int, segment: Segment, stream, **fields) -> None:
        """``fields``: the overlapped pass's sync, mode, n_chains, wait_spins (else 0)."""
        device.launch(self.fn, grid, self.block, self.smem,
                      self.params.at(g_lo=segment[0], g_hi=segment[1], smem_bytes=self.smem,
                                     **fields), stream)


class Fork:
    """The streams of a pass: the chain stream and ``segments`` group streams start after the
    work queued on ``here`` (torch's current stream), which waits for all of theirs
    (:meth:`join`), so that buffers go back to torch's allocator ordered after their use."""

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


def _run_pass(device, p: Problem, grp: ChunkGroups, plan: Plan, segments: list[Segment],
              spins: int, split: int, local: Kernel | None, chain: Kernel | None,
              group: Kernel | None) -> None:
    """A pass's launches: ``local`` (bwd_local; None in the forward), the chain (None: not
    run), then the group kernel (fwd_out, bwd_grads with ``split`` blocks per group; None:
    fused or not run). Segmented (``segments`` in launch order): every ``local`` at once on
    group streams; the chain takes a segment once its ``local`` is done, and its group kernel
    runs beside the chain's next segment.

    Overlapped (csrc/overlap.cuh): a zeroed sync buffer (before the fork), the chain on the
    chain stream, the group kernel (kOverlap, a block per ticket) beside it, then the join and
    the cleanup launch (kCleanup) of the tickets handed back. The group stream first waits
    until every chain block has started (``spins`` 0: not at all)."""
    here, N, H = device.current_stream(), p.N, p.H

    def blocks(seg: Segment) -> int:     # (group, head) blocks of a group kernel
        return (grp.count if seg[1] <= seg[0] else N * (seg[1] - seg[0])) * H

    with device.active():
        if len(segments) == 1:
            if local is not None:
                local.launch(device, blocks(WHOLE), WHOLE, here)
            if plan.overlap:
                n, tickets = N * H, N * H * grp.groups_max * split
                sync = torch.zeros(sync_words(n, tickets), dtype=torch.int32, device=p.q.device)
                fork = Fork(device, here, 1)
                chain.launch(device, n, WHOLE, fork.chain, sync=sync)
                if spins > 0:
                    device.wait_value(fork.group(0), sync.data_ptr(), n)  # overlap::kStarted
                tail = dict(sync=sync, n_chains=n, wait_spins=spins)
                group.launch(device, tickets, WHOLE, fork.group(0), mode=1, **tail)  # kOverlap
                fork.join()
                group.launch(device, tickets, WHOLE, here, mode=2, **tail)           # kCleanup
                return
            if chain is not None:
                chain.launch(device, N * H, WHOLE, here)
            if group is not None:
                group.launch(device, blocks(WHOLE) * split, WHOLE, here)
            return
        fork = Fork(device, here, len(segments))
        local_done = []
        for i, seg in enumerate(segments if local is not None else ()):
            local.launch(device, blocks(seg), seg, fork.group(i))
            local_done.append(fork.group(i).record_event())
        for i, seg in enumerate(segments):
            if local is not None:
                fork.chain.wait_event(local_done[i])
            chain.launch(device, N * H, seg, fork.chain)
            if group is not None:
                fork.group(i).wait_event(fork.chain.record_event())
                group.launch(device, blocks(seg) * split, seg, fork.group(i))
        fork.join()


@dataclass(frozen=True)
class _ForwardSetup:
    grp: ChunkGroups
    plan: Plan
    chain: tuple          # (kernel, block, smem)
    out: tuple | None     # fwd_out's, None when the chain is fused


@dataclass(frozen=True)
class _DecodeSetup:
    """fwd_decode's launch; ``native``: it reads eta, w, b, eta_key as given (_native_params)."""

    kernel: Any
    block: int
    smem: int
    rows: int
    native: bool = False


@dataclass(frozen=True)
class _BackwardSetup:
    plan: Plan
    split: int            # bwd_grads' blocks per group
    local: tuple          # (kernel, block, smem) of bwd_local, the chain, bwd_grads
    chain: tuple
    grads: tuple


_FORWARD_SETUPS: dict[tuple, _ForwardSetup | _DecodeSetup] = {}
_BACKWARD_SETUPS: dict[tuple, _BackwardSetup] = {}


def _forward_setup(p: Problem, save_for_backward: bool, schedule: Schedule,
                   device) -> _ForwardSetup | _DecodeSetup:
    native = _native_params(p)
    key = _setup_key(p, device, save_for_backward, schedule, native)
    setup = _FORWARD_SETUPS.get(key)
    if setup is not None:
        return setup
    dtype_name, dp, bt = _dtype_name(p.q), d_pad(p.D), p.chunk_size
    if row_step(p, save_for_backward, device.smem_limit, schedule):
        # fwd_decode: shared memory for the longest sequence's rows; one kernel at every chunk
        # size and tensor-core setting
        rows = decode_rows(max(p.seq_lens, default=0))
        kern = device.kernels(DECODE_PASS, dtype_name, dp, bt, False, **_variant(p),
                              native_params=native)
        setup = _DecodeSetup(kern[DECODE_KERNEL], decode_threads(dp),
                             decode_smem_bytes(dp, rows), rows, native)
    else:
        grp = ChunkGroups.of(p, CKPT_INTERVAL)
        plan = forward_plan(p, grp.groups_max, save_for_backward, schedule)
        mma = device.uses_mma(dtype_name, config().mma)
        if save_for_backward:      # the backward's program compiles while the forward's does
            device.prefetch("bwd", dtype_name, dp, bt, mma, **_variant(p))
        kern = device.kernels("fwd", dtype_name, dp, bt, mma, **_variant(p))
        chain = (kern[FUSED_NAME if plan.fuse else "fwd_chain"], threads(dp, "fwd_chain", mma),
                 smem_bytes("fwd_chain", dp, bt, mma, plan.fuse))
        out = None if plan.fuse else (kern["fwd_out"], threads(dp),
                                      smem_bytes("fwd_out", dp, bt, mma))
        setup = _ForwardSetup(grp, plan, chain, out)
    _keep(_FORWARD_SETUPS, key, setup)
    return setup


def _native_params(p: Problem) -> bool:
    """Whether fwd_decode reads eta, w, b (and eta_key) as they are (its P = T instance): half
    inputs with all of them in the input dtype, the usual generation call (no cast kernels)."""
    dtype = p.q.dtype
    return dtype != torch.float32 and all(
        t.dtype == dtype for t in (p.eta, p.w, p.b, p.eta_key) if t is not None)


def _final_states(p: Problem, H: int, D: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not p.output_final_state:
        return None, None
    f = dict(dtype=torch.float32, device=p.q.device)
    return torch.empty(p.N, H, D, D, **f), torch.empty(p.N, H, 1, D, **f)


def ttt_linear_fwd(p: Problem, save_for_backward: bool, *, schedule: Schedule = AUTO,
                   device=None):
    """Returns (o, ht, hbt, saved); ht/hbt None unless output_final_state, saved None unless
    save_for_backward."""
    device = device or cuda_device(p.q.device)
    setup = _forward_setup(p, save_for_backward, schedule, device)
    if isinstance(setup, _DecodeSetup):
        return _decode_step(p, setup, device)
    B, T, H, D = p.q.shape
    grp, plan = setup.grp, setup.plan
    f = dict(dtype=torch.float32, device=p.q.device)
    ht, hbt = _final_states(p, H, D)
    save = save_for_backward or not plan.fuse     # fwd_out reads the slots and xhat, r
    ck = torch.empty(grp.slots, H, D, D, **f) if save else None
    ckb = torch.empty(grp.slots, H, D, **f) if save else None
    xbuf = torch.empty(p.q.shape, **f) if save else None    # xhat
    rbuf = torch.empty(B, T, H, **f) if save else None      # r (with eta_key: l r)
    rlbuf = torch.empty(B, T, H, **f) if save and p.eta_key is not None else None
    eta, w, b, ekey = f32(p.eta), f32(p.w), f32(p.b), f32(p.eta_key)
    h0, hb0 = f32(p.initial_state), f32(p.initial_state_bias)
    o = torch.empty_like(p.q)
    params = FwdParams(q=p.q, k=p.k, v=p.v, eta=eta, lnw=w, lnb=b, h0=h0, hb0=hb0, ht=ht,
                       hbt=hbt, ck=ck, ckb=ckb, xbuf=xbuf, rbuf=rbuf, o=o, ekey=ekey,
                       rlbuf=rlbuf, cu_seqlens=p.cu_seqlens, grp_offsets=grp.offsets,
                       grp_seq=grp.seq, T_len=T, scale=p.scale, eps=p.eps, H=H, D=D, G=grp.G)
    out = None if plan.fuse else Kernel(*setup.out, params)  # (fused: the chain writes o)
    _run_pass(device, p, grp, plan, plan.segments, schedule.overlap_spins, 1, None,
              Kernel(*setup.chain, params), out)
    saved = (Saved(ck, ckb, xbuf, rbuf, grp, (eta, w, b), rlbuf, ekey) if save_for_backward
             else None)
    return o, ht, hbt, saved


def _decode_step(p: Problem, setup: _DecodeSetup, device):
    """A short generation step: fwd_decode alone. Returns (o, ht, hbt, None)."""
    B, T, H, D = p.q.shape
    ht, hbt = _final_states(p, H, D)
    o = torch.empty_like(p.q)
    eta, w, b, ekey = p.eta, p.w, p.b, p.eta_key     # (a Problem's tensors are contiguous)
    if not setup.native:
        eta, w, b, ekey = f32(eta), f32(w), f32(b), f32(ekey)
    args = DecodeParams(q=p.q, k=p.k, v=p.v, eta=eta, lnw=w, lnb=b, ekey=ekey,
                        h0=f32(p.initial_state), hb0=f32(p.initial_state_bias), ht=ht, hbt=hbt,
                        o=o, cu_seqlens=p.cu_seqlens, T_len=T, smem_bytes=setup.smem,
                        scale=p.scale, eps=p.eps, H=H, D=D, rows=setup.rows)
    with device.active():
        device.launch(setup.kernel, p.N * H, setup.block, setup.smem, args,
                      device.current_stream())
    return o, ht, hbt, None


def _backward_setup(p: Problem, grp: ChunkGroups, run_grads: bool, schedule: Schedule,
                    device) -> _BackwardSetup:
    """``run_grads``: bwd_grads' work runs."""
    key = _setup_key(p, device, run_grads, schedule)
    setup = _BACKWARD_SETUPS.get(key)
    if setup is not None:
        return setup
    dtype_name = _dtype_name(p.q)
    dp, bt = d_pad(p.D), p.chunk_size
    mma = device.uses_mma(dtype_name, config().mma)
    kern = device.kernels("bwd", dtype_name, dp, bt, mma, **_variant(p))
    split = grads_split(dp, bt)
    plan = backward_plan(p, grp.groups_max, split, mma, device.smem_limit, schedule)
    if not run_grads:  # the unfused chain alone after bwd_local, or bwd_local alone
        plan = replace(plan, fuse=False, overlap=False, segments=[WHOLE])
    nt = threads(dp)
    local = (kern["bwd_local"], nt, smem_bytes("bwd_local", dp, bt, mma))
    chain = (kern[FUSED_BWD_NAME if plan.fuse else "bwd_chain"], threads(dp, "bwd_chain", mma),
             bwd_chain_fused_smem_bytes(dp, bt) if plan.fuse
             else smem_bytes("bwd_chain", dp, bt, mma))
    grads = (kern["bwd_grads"], nt, smem_bytes("bwd_grads", dp, bt))
    setup = _BackwardSetup(plan, split, local, chain, grads)
    _keep(_BACKWARD_SETUPS, key, setup)
    return setup


def ttt_linear_bwd(p: Problem, saved: Saved, do, dht, dhbt, *, needs: GradNeeds | None = None,
                   schedule: Schedule = AUTO, device=None):
    """The :class:`ttt.Gradients` (dw/db [H, D], deta and deta_key [B, T, H, 1] fp32); None
    for those ``needs`` (default: all) does not ask for or the problem lacks; the others
    bitwise those of the full backward."""
    if saved is None:
        raise RuntimeError("the cupy backward needs the checkpoint slots of a forward run "
                           "with needs_backward=True")
    device = device or cuda_device(p.q.device)
    grp = saved.groups
    needs = needs or GradNeeds()
    want = dict(
        dh0=needs.initial_state and p.initial_state is not None,
        dhb0=needs.initial_state_bias and p.initial_state_bias is not None,
        deta=needs.eta and p.eta_is_tensor, dkey=needs.eta_key and p.eta_key is not None,
        dk=needs.k, dv=needs.v, dw=needs.w, db=needs.b)
    want_dh0 = want["dh0"] or want["dhb0"]
    run_grads = needs.k or needs.v or needs.w or needs.b          # bwd_grads' outputs
    run_chain = run_grads or want_dh0 or want["deta"] or want["dkey"]
    setup = _backward_setup(p, grp, run_grads, schedule, device)
    plan, split = setup.plan, setup.split
    do, dht, dhbt = do.contiguous(), f32(dht), f32(dhbt)
    q = p.q
    B, T, H, D = q.shape
    # the outputs and work buffers (fp32 but dq, dk, dv; None: not computed)
    f = dict(dtype=torch.float32, device=q.device)
    dopbuf, dgbuf = torch.empty(q.shape, **f), torch.empty(q.shape, **f)  # do_pre; dg
    dq = torch.empty_like(q)
    deta = torch.empty(B, T, H, 1, **f)
    dwbp = torch.empty(2, 2, grp.count, H, D, **f)  # dw, db partials: bwd_local, bwd_grads
    dh0 = torch.empty(p.N, H, D, D, **f) if want_dh0 else None
    dhb0 = torch.empty(p.N, H, 1, D, **f) if want_dh0 else None
    dck, dckb = torch.empty_like(saved.ck), torch.empty_like(saved.ckb)   # the slots'
    dk, dv = (torch.empty_like(q), torch.empty_like(q)) if run_grads else (None, None)
    dkey = torch.empty(B, T, H, 1, **f) if want["dkey"] else None
    eta, w, b = saved.f32
    dwp, dbp = dwbp[0], dwbp[1]
    params = BwdParams(q=q, k=p.k, v=p.v, dout=do, eta=eta, lnw=w, lnb=b, ck=saved.ck,
                       ckb=saved.ckb, xbuf=saved.xbuf, rbuf=saved.rbuf, rlbuf=saved.rlbuf,
                       dopbuf=dopbuf, dgbuf=dgbuf, dq=dq, dk=dk, dv=dv, deta=deta,
                       dwp_local=dwp[0], dbp_local=dbp[0], dwp=dwp[1], dbp=dbp[1], dht=dht,
                       dhbt=dhbt, dck=dck, dckb=dckb, dh0=dh0, dhb0=dhb0, dkey=dkey,
                       cu_seqlens=p.cu_seqlens, grp_offsets=grp.offsets, grp_seq=grp.seq,
                       T_len=T, scale=p.scale, eps=p.eps, H=H, D=D, G=grp.G)
    # (not run_grads: a plain plan, bwd_local alone or with the unfused chain)
    _run_pass(device, p, grp, plan, plan.segments[::-1], schedule.overlap_spins, split,
              Kernel(*setup.local, params), Kernel(*setup.chain, params) if run_chain else None,
              Kernel(*setup.grads, params) if run_grads and not plan.fuse else None)
    # [H, D]: each its own tensor (the custom op refuses returns that share storage), and
    # not reduced where not needed
    dw = dwbp[0].sum((0, 1)) if want["dw"] else None
    db = dwbp[1].sum((0, 1)) if want["db"] else None
    def kept(name, t):
        return t if want[name] else None

    return Gradients(dq=dq if needs.q else None, dk=kept("dk", dk), dv=kept("dv", dv), dw=dw,
                     db=db, deta=kept("deta", deta), deta_key=kept("dkey", dkey),
                     dh0=kept("dh0", dh0), dhb0=kept("dhb0", dhb0))
