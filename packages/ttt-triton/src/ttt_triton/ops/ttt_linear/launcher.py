"""Launchers: allocate outputs, pick block sizes and launch the forward / backward kernels.

Every launch choice comes from the rules and tables of :mod:`.tuning`; ``tuning=`` (a
:class:`~.tuning.Tuning`) forces any of them, for tests and benchmark sweeps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.runtime.errors import OutOfResources

from ttt import Problem
from ttt.chunking import ChunkGroups, group_offsets

from ..._env import interpreting
from .bwd_chain import ttt_linear_bwd_chain_kernel
from .bwd_grads import ttt_linear_bwd_grads_kernel
from .bwd_local import ttt_linear_bwd_local_kernel
from .fwd_chain import ttt_linear_fwd_chain_kernel
from .fwd_out import ttt_linear_fwd_out_kernel
from .tuning import (
    DEFAULT_TUNING,
    WIDE_BACKWARD,
    Tuning,
    checkpoint_interval,
    dot_precision,
    fused_backward,
    fused_forward,
    grads_split,
    launch_options,
    rows_per_block,
    unfit_tuning_error,
    wide_backward,
)


def block_sizes(D: int, chunk_size: int) -> tuple[int, int]:
    return chunk_size, max(16, triton.next_power_of_2(D))


def _checked(tuning: Tuning) -> Tuning:
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning: expected a ttt_triton.ops.ttt_linear.tuning.Tuning, "
                        f"got {type(tuning).__name__}")
    return tuning


def _refusing_unfit_tunings(launcher):
    """A forced Tuning whose kernel needs more shared memory (or registers) than the device
    has is refused with a ValueError naming its fields, the need and the limit, raised when
    Triton loads that kernel, before it runs (the rules' own choices always fit)."""

    @functools.wraps(launcher)
    def run(problem, *args, tuning: Tuning = DEFAULT_TUNING, **kwargs):
        try:
            return launcher(problem, *args, tuning=tuning, **kwargs)
        except OutOfResources as err:
            if tuning == DEFAULT_TUNING:
                raise
            raise unfit_tuning_error(tuning, err.name, err.required, err.limit) from err

    return run


def _launch(kind: str, BD: int, dtype: torch.dtype, tune: Tuning,
            fused_bwd: bool = False) -> dict:
    if interpreting():
        return {}
    return launch_options(kind, BD, dtype == torch.float32, tune, fused_bwd)


@dataclass
class Saved:
    """What the forward keeps for the backward: the fp32 state slots, every row's xhat and
    r (from which g is row-local) and the grouping."""

    ck: torch.Tensor          # [slots, H, D, D] fp32
    ckb: torch.Tensor         # [slots, H, D] fp32
    xbuf: torch.Tensor        # [B, T, H, D] fp32
    rbuf: torch.Tensor        # [B, T, H] fp32
    groups: ChunkGroups

    def tensors(self) -> list[torch.Tensor]:
        """The backend interface's ``saved``: the tensors, in :func:`saved_shapes`' order
        (a packed batch's group offsets and group -> sequence map too: no copies again)."""
        grouping = [] if self.groups.offsets is None else [self.groups.offsets, self.groups.seq]
        return [self.ck, self.ckb, self.xbuf, self.rbuf, *grouping]

    @classmethod
    def of(cls, p: Problem, tensors: list[torch.Tensor]) -> Saved:
        """Back from :meth:`tensors`; the grouping is the forward's, derived from ``p``."""
        ck, ckb, xbuf, rbuf, *grouping = tensors
        groups = ChunkGroups.of(p, chunks_per_group(p), tuple(grouping) or None)
        return cls(ck, ckb, xbuf, rbuf, groups)


def chunks_per_group(p: Problem) -> int:
    """G of ``p``'s forward by the rules (:func:`checkpoint_interval`, no forced tuning)."""
    return checkpoint_interval(p, block_sizes(p.D, p.chunk_size)[1], DEFAULT_TUNING)


def saved_shapes(p: Problem) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of :meth:`Saved.tensors` of a forward of ``p`` with a backward."""
    count = group_offsets(p, chunks_per_group(p))[-1]
    B, T, H, D = p.q.shape
    grouping = [((p.N + 1,), torch.int64), ((count,), torch.int32)] if p.is_varlen else []
    return [((count + p.N, H, D, D), torch.float32), ((count + p.N, H, D), torch.float32),
            ((B, T, H, D), torch.float32), ((B, T, H), torch.float32), *grouping]


def _initial_states(p: Problem):
    h0, hb0 = p.initial_state, p.initial_state_bias
    if h0 is None and hb0 is None:
        return None, None
    dev = p.q.device
    h0 = (torch.zeros(p.N, p.H, p.D, p.D, dtype=torch.float32, device=dev) if h0 is None
          else h0.float().contiguous())
    hb0 = (torch.zeros(p.N, p.H, 1, p.D, dtype=torch.float32, device=dev) if hb0 is None
           else hb0.float().contiguous())
    return h0, hb0


@_refusing_unfit_tunings
def ttt_linear_fwd(problem: Problem, save_for_backward: bool, *,
                   tuning: Tuning = DEFAULT_TUNING):
    """Returns (o, ht, hbt, saved); ht/hbt None unless output_final_state, saved None unless
    save_for_backward."""
    p = problem
    q, k, v, w, b, eta, cu_seqlens = p.q, p.k, p.v, p.w, p.b, p.eta, p.cu_seqlens
    B, T, H, D = q.shape
    N = p.N
    BT, BD = block_sizes(D, p.chunk_size)
    dev = q.device
    tune = _checked(tuning)
    grp = ChunkGroups.of(p, checkpoint_interval(p, BD, tune))
    G = grp.G
    ht = hbt = None
    if p.output_final_state:
        ht = torch.empty(N, H, D, D, dtype=torch.float32, device=dev)
        hbt = torch.empty(N, H, 1, D, dtype=torch.float32, device=dev)
    h0, hb0 = _initial_states(p)
    fuse = fused_forward(p, save_for_backward, tune)
    save = save_for_backward or not fuse     # fwd_out reads the slots and xhat, r
    ck = ckb = xbuf = rbuf = None
    if save:
        ck = torch.empty(grp.slots, H, D, D, dtype=torch.float32, device=dev)
        ckb = torch.empty(grp.slots, H, D, dtype=torch.float32, device=dev)
        xbuf = torch.empty(q.shape, dtype=torch.float32, device=dev)
        rbuf = torch.empty(B, T, H, dtype=torch.float32, device=dev)
    prec = dot_precision(q.dtype, BD)
    varlen = cu_seqlens is not None
    half = q.dtype != torch.float32
    o = torch.empty_like(q)

    ttt_linear_fwd_chain_kernel[(N * H,)](
        q, k, v, eta, w, b, o, h0, hb0, ht, hbt, ck, ckb, xbuf, rbuf, cu_seqlens,
        grp.offsets, float(p.scale), float(p.eps), T,
        H=H, D=D, BT=BT, BD=BD, G=G, USE_INITIAL=h0 is not None,
        STORE_FINAL=p.output_final_state, IS_VARLEN=varlen, FUSE_OUT=fuse, SAVE=save,
        HALF=half, PREC=prec, **_launch("chain", BD, q.dtype, tune))
    if not fuse:
        ttt_linear_fwd_out_kernel[(grp.count, H)](
            q, k, v, eta, w, b, ck, ckb, xbuf, rbuf, o, cu_seqlens, grp.offsets, grp.seq,
            float(p.scale), float(p.eps), T,
            H=H, D=D, BT=BT, BS=rows_per_block("S_out", BT, G, tune), BD=BD, G=G,
            IS_VARLEN=varlen, HALF=half, PREC=prec, **_launch("group", BD, q.dtype, tune))
    saved = Saved(ck, ckb, xbuf, rbuf, grp) if save_for_backward else None
    return o, ht, hbt, saved


@_refusing_unfit_tunings
def ttt_linear_bwd(problem: Problem, saved: Saved, do, dht, dhbt, *,
                   tuning: Tuning = DEFAULT_TUNING):
    """Returns (dq, dk, dv, dw, db, deta, dh0, dhb0); dw/db [H, D] fp32, deta [B, T, H, 1]
    fp32, dh0/dhb0 None without initial states."""
    p = problem
    q, k, v, w, b, eta, cu_seqlens = p.q, p.k, p.v, p.w, p.b, p.eta, p.cu_seqlens
    want_dh0 = p.initial_state is not None or p.initial_state_bias is not None
    B, T, H, D = q.shape
    N = p.N
    BT, BD = block_sizes(D, p.chunk_size)
    grp = saved.groups
    G = grp.G
    tune = _checked(tuning)
    dev = q.device
    prec = dot_precision(q.dtype, BD)
    varlen = cu_seqlens is not None
    f32 = dict(dtype=torch.float32, device=dev)

    xbuf, rbuf = saved.xbuf, saved.rbuf
    dopbuf = torch.empty(q.shape, **f32)
    dgbuf = torch.empty(q.shape, **f32)
    dq = torch.empty_like(q)
    deta = torch.empty(B, T, H, 1, **f32)
    fuse = fused_backward(p, tune)          # bwd_grads' work done by the backward chain
    dwp = torch.empty(1 if fuse else 2, grp.count, H, D, **f32)
    dbp = torch.empty(1 if fuse else 2, grp.count, H, D, **f32)
    group_launch = _launch("group", BD, q.dtype, tune)
    if group_launch and wide_backward(q.dtype, BD, BT):
        group_launch["num_stages"] = WIDE_BACKWARD["stages"]
    ttt_linear_bwd_local_kernel[(grp.count, H)](
        q, k, v, eta, w, b, do, saved.ck, saved.ckb, xbuf, rbuf, dopbuf, dgbuf,
        dq, deta, dwp[0], dbp[0], cu_seqlens, grp.offsets, grp.seq,
        float(p.scale), float(p.eps), T,
        H=H, D=D, BT=BT, BS=rows_per_block("S_local", BT, G, tune), BD=BD, G=G,
        IS_VARLEN=varlen, HALF=q.dtype != torch.float32, PREC=prec, **group_launch)

    dh0 = dhb0 = None
    if want_dh0:
        dh0 = torch.empty(N, H, D, D, **f32)
        dhb0 = torch.empty(N, H, 1, D, **f32)
    use_dht = dht is not None or dhbt is not None
    if use_dht:
        dht = torch.zeros(N, H, D, D, **f32) if dht is None else dht.contiguous()
        dhbt = torch.zeros(N, H, 1, D, **f32) if dhbt is None else dhbt.contiguous()
    dk = torch.empty_like(q)
    dv = torch.empty_like(q)
    dck = desum = dwc = dbc = None
    if fuse:
        dwc = torch.empty(N, H, D, **f32)
        dbc = torch.empty(N, H, D, **f32)
    else:
        dck = torch.empty_like(saved.ck)
        desum = torch.empty(B, T, H, **f32)
    ttt_linear_bwd_chain_kernel[(N * H,)](
        q, k, v, eta, w, b, xbuf, rbuf, dopbuf, dgbuf, desum, dht, dhbt, dck, dh0, dhb0,
        saved.ck, dk, dv, deta, dwc, dbc, cu_seqlens, grp.offsets, float(p.scale), T,
        H=H, D=D, BT=BT, BD=BD, G=G, USE_DHT=use_dht, STORE_DH0=want_dh0,
        IS_VARLEN=varlen, FUSE_GRADS=fuse, PREC=prec,
        **_launch("chain", BD, q.dtype, tune, fused_bwd=fuse))
    if fuse:
        return dq, dk, dv, dwp[0].sum(0) + dwc.sum(0), dbp[0].sum(0) + dbc.sum(0), deta, \
            dh0, dhb0

    split = grads_split(q.dtype, BD, BT, tune)
    ttt_linear_bwd_grads_kernel[(grp.count, H, split)](
        q, k, v, eta, w, b, saved.ck, dck, xbuf, rbuf, dopbuf, dgbuf, desum,
        dk, dv, deta, dwp[1], dbp[1], cu_seqlens, grp.offsets, grp.seq,
        float(p.scale), T,
        H=H, D=D, BT=BT, BS=rows_per_block("S_grads", BT, G, tune), BD=BD, G=G,
        IS_VARLEN=varlen, PREC=prec, SPLIT=split, **group_launch)
    return dq, dk, dv, dwp.sum((0, 1)), dbp.sum((0, 1)), deta, dh0, dhb0
