"""The forward and backward passes: buffers from torch, kernels launched through CuPy on
torch's current stream (raw ``data_ptr()`` addresses, zero copy), in the schedule that
:mod:`ttt_cupy.placement` picks.

Forward: fwd_chain (per (sequence, head): the state chain, the checkpoint slots, xhat and r),
then fwd_out (per (group, head): the outputs); or fwd_chain's fused instance alone; or, for a
generation step of a few rows per sequence (placement.row_step), fwd_decode alone. Backward:
bwd_local (per group), bwd_chain (per sequence, reverse), bwd_grads (per group, reverse); or
the fused backward chain instead of the last two. ``eta_key`` and the output form pick the
kernels' variant (:func:`ttt_cupy.compile.kernel_name`), compiled when first needed. The
backward computes only what ``needs`` asks for where the kernels allow: no bwd_grads without
dk, dv, dw, db; no backward chain when only dq is needed; no dw, db reductions, dh0 / dhb0 or
deta_key buffers that nobody asked for. Every tensor returned is a new one (no input, no view
of another result).

What a pass's launches take besides its tensors (the grouping, the plan, the kernels with
their block and shared memory sizes, the scalar arguments) is kept per configuration of a
dense batch (:func:`_forward_setup`, :func:`_backward_setup`): a call like one before it (a
generation step, a training step) only allocates, takes addresses and launches.

``device`` (default: the inputs' :class:`~ttt_cupy.device.CudaDevice`) is the one seam to
the GPU: tests pass a stand-in that records the launches or runs them in the CPU emulation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ttt import GradNeeds, Problem
from ttt.chunking import ChunkGroups

from . import layout
from .compile import DECODE_KERNEL, DECODE_PASS, FUSED_BWD_NAME, FUSED_NAME, d_pad
from .config import AUTO, Schedule, config
from .device import cuda_device
from .layout import BackwardBuffers, Kernel, Saved, f32, group_blocks
from .placement import CKPT_INTERVAL, Plan, backward_plan, forward_plan, row_step
from .smem import (
    bwd_chain_fused_smem_bytes,
    decode_rows,
    decode_smem_bytes,
    decode_threads,
    grads_split,
    smem_bytes,
    threads,
)
from .streams import WHOLE, Fork, overlap_sync, run_overlapped

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _dtype_name(q: torch.Tensor) -> str:
    if q.dtype not in _DTYPE_NAMES:
        raise TypeError(f"q: expected float32, float16 or bfloat16 for the cupy kernels, "
                        f"got {q.dtype}")
    return _DTYPE_NAMES[q.dtype]


def saved_shapes(p: Problem) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return layout.saved_shapes(p, CKPT_INTERVAL)


def saved_of(p: Problem, tensors: list[torch.Tensor]) -> Saved:
    return Saved.of(p, tensors, CKPT_INTERVAL)


def _variant(p: Problem) -> dict:
    """The kernels' variant of ``p`` as keyword arguments of ``device.kernels`` (none for the
    default: eta_key None, norm_residual)."""
    v = {}
    if p.eta_key is not None:
        v["key"] = True
    if p.output != "norm_residual":
        v["out"] = p.output
    return v


@dataclass(frozen=True)
class _ForwardSetup:
    """What a forward's launches take besides its tensors: the grouping, the schedule, the
    kernels with their block and shared memory sizes."""

    grp: ChunkGroups
    plan: Plan
    chain: tuple          # (kernel, block, smem)
    out: tuple | None     # fwd_out's, None when the chain is fused


@dataclass(frozen=True)
class _DecodeSetup:
    """A short generation step's launch (placement.row_step) besides its tensors: fwd_decode,
    its block and shared memory, its rows, and whether it reads eta, w, b, eta_key as given
    (:func:`_native_params`) or in fp32."""

    kernel: Any
    block: int
    smem: int
    rows: int
    native: bool = False


MAX_SETUPS = 64
"""Setups kept per pass (dense batches); past this many they are all made again."""

_FORWARD_SETUPS: dict[tuple, _ForwardSetup] = {}
_BACKWARD_SETUPS: dict[tuple, _BackwardSetup] = {}


def _forward_setup(p: Problem, save_for_backward: bool, schedule: Schedule,
                   device) -> _ForwardSetup | _DecodeSetup:
    """The setup of ``p``'s forward (a :class:`_DecodeSetup` for a short generation step,
    placement.row_step); for a dense batch kept per (device, shape, dtype and options), so
    that a call of a configuration seen before (a generation step) looks it up (a packed
    batch's is made each call: its grouping has device tensors of its own)."""
    native = _native_params(p)
    key = None if p.is_varlen else (
        device, p.q.shape, p.q.dtype, p.chunk_size, p.output, p.eta_key is not None,
        p.scale, p.eps, save_for_backward, schedule, config().mma, native)
    setup = _FORWARD_SETUPS.get(key)
    if setup is None:
        if row_step(p, save_for_backward, device.smem_limit, schedule):
            setup = _decode_setup(p, device, native)
        else:
            setup = _chunked_setup(p, save_for_backward, schedule, device)
        _keep(_FORWARD_SETUPS, key, setup)
    return setup


def _decode_setup(p: Problem, device, native: bool) -> _DecodeSetup:
    """fwd_decode's launch for ``p``: shared memory for its longest sequence's rows
    (smem.decode_rows); the same kernel at every chunk size and tensor-core setting, its
    instance reading eta, w, b, eta_key in the input type where ``native``
    (:func:`_native_params`)."""
    dp = d_pad(p.D)
    rows = decode_rows(max(p.seq_lens, default=0))
    smem = decode_smem_bytes(dp, rows)
    kern = device.kernels(DECODE_PASS, _dtype_name(p.q), dp, p.chunk_size, False,
                          **_variant(p), native_params=native)
    return _DecodeSetup(kern[DECODE_KERNEL], decode_threads(dp), smem, rows, native)


def _native_params(p: Problem) -> bool:
    """Whether fwd_decode takes eta, w, b (and eta_key) as they are, in half inputs' dtype
    (its P = T instance, which widens them on load): the usual generation call has every
    tensor in the input dtype, and would otherwise cost a cast kernel each. Any other mix
    (a float32 one among them) keeps the fp32 instance, the others cast (float32 inputs:
    nothing to cast either way)."""
    dtype = p.q.dtype
    return dtype != torch.float32 and all(
        t.dtype == dtype for t in (p.eta, p.w, p.b, p.eta_key) if t is not None)


def _chunked_setup(p: Problem, save_for_backward: bool, schedule: Schedule,
                   device) -> _ForwardSetup:
    """The setup of ``p``'s forward through the chunked kernels (fwd_chain, fwd_out)."""
    dtype_name = _dtype_name(p.q)
    dp, bt = d_pad(p.D), p.chunk_size
    grp = ChunkGroups.of(p, CKPT_INTERVAL)
    plan = forward_plan(p, grp.groups_max, save_for_backward, schedule)
    mma = device.uses_mma(dtype_name, config().mma)
    if save_for_backward:      # the backward's program compiles while the forward's does
        device.prefetch("bwd", dtype_name, dp, bt, mma, **_variant(p))
    kern = device.kernels("fwd", dtype_name, dp, bt, mma, **_variant(p))
    chain = (kern[FUSED_NAME if plan.fuse else "fwd_chain"], threads(dp, "fwd_chain", mma),
             smem_bytes("fwd_chain", dp, bt, mma, plan.fuse))
    out = None if plan.fuse else (kern["fwd_out"], threads(dp), smem_bytes("fwd_out", dp, bt, mma))
    return _ForwardSetup(grp, plan, chain, out)


def _keep(setups: dict, key: tuple | None, setup) -> None:
    """Keep ``setup`` under ``key`` (None: not kept); all forgotten past MAX_SETUPS."""
    if key is None:
        return
    if len(setups) >= MAX_SETUPS:
        setups.clear()
    setups[key] = setup


def ttt_linear_fwd(p: Problem, save_for_backward: bool, *, schedule: Schedule = AUTO,
                   device=None):
    """Returns (o, ht, hbt, saved); ht/hbt None unless output_final_state, saved None unless
    save_for_backward."""
    device = device or cuda_device(p.q.device)
    B, T, H, D = p.q.shape
    N = p.N
    setup = _forward_setup(p, save_for_backward, schedule, device)
    if isinstance(setup, _DecodeSetup):
        return _decode_step(p, setup, device)
    grp, plan = setup.grp, setup.plan
    f = dict(dtype=torch.float32, device=p.q.device)
    ht = torch.empty(N, H, D, D, **f) if p.output_final_state else None
    hbt = torch.empty(N, H, 1, D, **f) if p.output_final_state else None
    save = save_for_backward or not plan.fuse     # fwd_out reads the slots and xhat, r
    ck = torch.empty(grp.slots, H, D, D, **f) if save else None
    ckb = torch.empty(grp.slots, H, D, **f) if save else None
    xbuf = torch.empty(p.q.shape, **f) if save else None    # xhat
    rbuf = torch.empty(B, T, H, **f) if save else None      # r (with eta_key: l r)
    key = p.eta_key is not None
    rlbuf = torch.empty(B, T, H, **f) if save and key else None   # the LayerNorm's r
    eta, w, b, ekey = f32(p.eta), f32(p.w), f32(p.b), f32(p.eta_key)
    h0, hb0 = f32(p.initial_state), f32(p.initial_state_bias)
    o = torch.empty_like(p.q)
    params = layout.fwd_params(p, grp, eta, w, b, h0, hb0, ht, hbt, ck, ckb, xbuf, rbuf, o,
                               ekey, rlbuf)
    chain = Kernel(*setup.chain, params)
    out = None if plan.fuse else Kernel(*setup.out, params)  # (fused: the chain writes o)
    here = device.current_stream()
    tickets = N * H * grp.groups_max               # (overlapped: an fwd_out block each)
    with device.active():
        if plan.overlap:
            sync = overlap_sync(N * H, tickets, p.q.device)
            run_overlapped(device, chain, out, sync, N * H, tickets, schedule.overlap_spins,
                           Fork(device, here, 1))
        elif len(plan.segments) == 1:
            chain.launch(device, N * H, WHOLE, here)
            if not plan.fuse:
                out.launch(device, group_blocks(grp, N, WHOLE) * H, WHOLE, here)
        else:  # each segment's outputs beside the chain's next segment
            fork = Fork(device, here, len(plan.segments))
            for i, seg in enumerate(plan.segments):
                chain.launch(device, N * H, seg, fork.chain)
                fork.group(i).wait_event(fork.chain.record_event())
                out.launch(device, group_blocks(grp, N, seg) * H, seg, fork.group(i))
            fork.join()
    saved = (Saved(ck, ckb, xbuf, rbuf, grp, (eta, w, b), rlbuf, ekey) if save_for_backward
             else None)
    return o, ht, hbt, saved


def _decode_step(p: Problem, setup: _DecodeSetup, device):
    """A short generation step: fwd_decode alone, one block per (sequence, head); besides its
    launch only allocations: eta, w, b, eta_key go as they are (all in the input dtype: the
    kernel's P = T instance, :func:`_native_params`), else those not in float32 are cast
    first. Returns (o, ht, hbt, None)."""
    B, T, H, D = p.q.shape
    f = dict(dtype=torch.float32, device=p.q.device)
    ht = torch.empty(p.N, H, D, D, **f) if p.output_final_state else None
    hbt = torch.empty(p.N, H, 1, D, **f) if p.output_final_state else None
    o = torch.empty_like(p.q)
    params = (p.eta, p.w, p.b, p.eta_key)     # (a Problem's tensors are contiguous)
    if not setup.native:
        params = tuple(map(f32, params))
    args = layout.decode_params(p, *params, f32(p.initial_state), f32(p.initial_state_bias),
                                ht, hbt, o, setup.rows, setup.smem)
    here = device.current_stream()
    with device.active():
        device.launch(setup.kernel, p.N * H, setup.block, setup.smem, args, here)
    return o, ht, hbt, None


@dataclass(frozen=True)
class _BackwardSetup:
    """What a backward's launches take besides its tensors (see :class:`_ForwardSetup`)."""

    plan: Plan
    split: int            # bwd_grads' blocks per group
    local: tuple          # (kernel, block, smem) of bwd_local, the chain, bwd_grads
    chain: tuple
    grads: tuple


def _backward_setup(p: Problem, grp: ChunkGroups, run_grads: bool, schedule: Schedule,
                    device) -> _BackwardSetup:
    """The setup of ``p``'s backward (``run_grads``: bwd_grads' work runs); kept as the
    forward's is (:func:`_forward_setup`)."""
    key = None if p.is_varlen else (
        device, p.q.shape, p.q.dtype, p.chunk_size, p.output, p.eta_key is not None, p.scale,
        p.eps, run_grads, schedule, config().mma)
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
    """Returns (dq, dk, dv, dw, db, deta, dh0, dhb0, deta_key) (the field order of
    ttt.Gradients); dw/db [H, D] fp32, deta and deta_key [B, T, H, 1] fp32; None for those
    that ``needs`` (default: all) does not ask for, dh0/dhb0 without initial states, deta_key
    without eta_key. The gradients computed are bitwise those of the full backward."""
    if saved is None:
        raise RuntimeError("the cupy backward needs the checkpoint slots of a forward run "
                           "with needs_backward=True")
    device = device or cuda_device(p.q.device)
    H, N = p.H, p.N
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
    g = BackwardBuffers.of(p, saved, want_dh0, run_grads, want["dkey"])
    params = layout.bwd_params(p, saved, g, do, dht, dhbt)
    local = Kernel(*setup.local, params)
    chain = Kernel(*setup.chain, params)
    grads = Kernel(*setup.grads, params)

    def local_blocks(seg):
        return group_blocks(grp, N, seg) * H

    here = device.current_stream()
    with device.active():
        if not run_grads:
            local.launch(device, local_blocks(WHOLE), WHOLE, here)
            if run_chain:
                chain.launch(device, N * H, WHOLE, here)
        elif plan.overlap:  # bwd_local, then bwd_chain and bwd_grads at once
            local.launch(device, local_blocks(WHOLE), WHOLE, here)
            tickets = N * H * grp.groups_max * split
            sync = overlap_sync(N * H, tickets, p.q.device)
            run_overlapped(device, chain, grads, sync, N * H, tickets, schedule.overlap_spins,
                           Fork(device, here, 1))
        elif len(plan.segments) == 1:
            local.launch(device, local_blocks(WHOLE), WHOLE, here)
            chain.launch(device, N * H, WHOLE, here)
            if not plan.fuse:
                grads.launch(device, local_blocks(WHOLE) * split, WHOLE, here)
        else:
            # segments last to first: every bwd_local at once, each on a group stream; the
            # chain takes a segment once its bwd_local is done, bwd_grads follows the chain
            fork = Fork(device, here, len(plan.segments))
            order = list(reversed(plan.segments))
            local_done = []
            for i, seg in enumerate(order):
                local.launch(device, local_blocks(seg), seg, fork.group(i))
                local_done.append(fork.group(i).record_event())
            for i, seg in enumerate(order):
                fork.chain.wait_event(local_done[i])
                chain.launch(device, N * H, seg, fork.chain)
                if not plan.fuse:
                    fork.group(i).wait_event(fork.chain.record_event())
                    grads.launch(device, local_blocks(seg) * split, seg, fork.group(i))
            fork.join()
    # [H, D]: each its own tensor (the custom op refuses returns that share storage), and
    # not reduced where not needed
    dw = g.dwbp[0].sum((0, 1)) if want["dw"] else None
    db = g.dwbp[1].sum((0, 1)) if want["db"] else None
    kept = {name: t if want[name] else None
            for name, t in (("dk", g.dk), ("dv", g.dv), ("deta", g.deta), ("dh0", g.dh0),
                            ("dhb0", g.dhb0), ("dkey", g.dkey))}
    return (g.dq if needs.q else None, kept["dk"], kept["dv"], dw, db, kept["deta"],
            kept["dh0"], kept["dhb0"], kept["dkey"])
