"""Launchers: allocate outputs, pick block sizes and launch the forward / backward kernels.

Every launch choice comes from the rules and tables of :mod:`.tuning`; ``tuning=`` (a
:class:`~.tuning.Tuning`) forces any of them, for tests and benchmark sweeps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from triton.runtime.errors import OutOfResources

from ttt import Gradients, GradNeeds, Problem
from ttt.chunking import ChunkGroups, group_count

from ..._env import kernels_interpreted
from .bwd_chain import ttt_linear_bwd_chain_kernel
from .bwd_grads import ttt_linear_bwd_grads_kernel
from .bwd_local import ttt_linear_bwd_local_kernel
from .fwd_chain import ttt_linear_fwd_chain_kernel
from .fwd_decode import ttt_linear_fwd_decode_kernel
from .fwd_out import ttt_linear_fwd_out_kernel
from .launches import Launch
from .launches import prefetch as launches_prefetch
from .launches import run as launches_run
from .launches import wants_prefetch as launches_wants_prefetch
from .tuning import (
    DEFAULT_TUNING,
    WIDE_BACKWARD,
    Tuning,
    block_sizes,
    checkpoint_interval,
    decode_options,
    dot_precision,
    fused_backward,
    fused_forward,
    grads_split,
    launch_options,
    row_step,
    rows_per_block,
    unfit_tuning_error,
    wide_backward,
)


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
            fused_bwd: bool = False, BT: int = 16) -> dict:
    if kernels_interpreted():
        return {}
    return launch_options(kind, BD, dtype == torch.float32, tune, fused_bwd, BT)


def _rows(kind: str, BT: int, BD: int, G: int, dtype: torch.dtype, tune: Tuning) -> int:
    return rows_per_block(kind, BT, G, tune, BD=BD, ieee=dtype == torch.float32)


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
    count = group_count(p, chunks_per_group(p))
    B, T, H, D = p.q.shape
    grouping = [((p.N + 1,), torch.int64), ((count,), torch.int32)] if p.is_varlen else []
    return [((count + p.N, H, D, D), torch.float32), ((count + p.N, H, D), torch.float32),
            ((B, T, H, D), torch.float32), ((B, T, H), torch.float32), *grouping]


def _initial_states(p: Problem):
    """The initial states as fwd_chain reads them: float32 and contiguous (those that are
    already, as validated float32 states are, passed as they are); None where not given
    (fwd_chain starts that one from zeros)."""
    h0, hb0 = p.initial_state, p.initial_state_bias
    return (None if h0 is None else h0.float().contiguous(),
            None if hb0 is None else hb0.float().contiguous())


@dataclass
class _ForwardSetup:
    """What a forward's launches take besides its tensors and the few numbers of the call:
    the grouping, whether the chain writes the outputs (``fuse``) and whether the slots,
    xhat and r are stored (``save``), and each kernel's keyword arguments; and whether its
    backward was looked at for compiling ahead (:func:`_prefetch_backward`). A short
    generation step (``row_step``, :func:`.tuning.row_step`) runs fwd_decode alone, with
    ``chain`` its arguments."""

    grp: ChunkGroups | None   # None for a row step
    fuse: bool
    save: bool
    chain: dict           # fwd_chain's (or fwd_decode's) constexprs and launch options
    out: dict | None      # fwd_out's, None when the chain writes the outputs
    row_step: bool = False
    backward_ahead: bool = False


UNSAVED_G = 1
"""The G fwd_chain gets when it stores no slots (a fused forward without backward), where
nothing reads it: one kernel specialisation whatever the grouping's G."""

MAX_SETUPS = 64
"""Forward setups kept (dense batches); past this many they are all made again."""

_FORWARD_SETUPS: dict[tuple, _ForwardSetup] = {}


def _forward_setup(p: Problem, save_for_backward: bool, tune: Tuning) -> _ForwardSetup:
    """The setup of ``p``'s forward; for a dense batch kept per shape, dtype and options,
    so that a call like one before it (a generation step) looks it up (a packed batch's
    grouping may hold its own tensors: made each call)."""
    key = None if p.is_varlen else (
        p.q.shape, p.q.dtype, p.chunk_size, p.output_final_state, p.output,
        p.eta_key is not None, p.initial_state is not None,
        p.initial_state_bias is not None, save_for_backward, tune)
    setup = _FORWARD_SETUPS.get(key)
    if setup is not None:
        return setup
    H, D = p.H, p.D
    BT, BD = block_sizes(D, p.chunk_size)
    if row_step(p, save_for_backward, tune):
        return _kept(key, _row_step_setup(p, BD))
    fuse = fused_forward(p, save_for_backward, tune)
    save = save_for_backward or not fuse     # fwd_out reads the slots and xhat, r
    # without slots nothing reads the packed grouping's maps (fwd_chain reads its offsets
    # only for a slot index it then does not use): cu_seqlens stands in for both, sparing
    # the two host-to-device copies of a generation step
    cu_seqlens = p.cu_seqlens
    maps = None if save or cu_seqlens is None else (cu_seqlens, cu_seqlens)
    grp = ChunkGroups.of(p, checkpoint_interval(p, BD, tune), maps)
    G = grp.G
    prec = dot_precision(p.q.dtype, BD)
    varlen, half = cu_seqlens is not None, p.q.dtype != torch.float32
    forms = dict(HAS_ETA_KEY=p.eta_key is not None, OUTPUT=p.output)
    # (G sets the slots alone: a chain that stores none compiles one specialisation for any G)
    chain = dict(
        H=H, D=D, BT=BT, BD=BD, G=G if save else UNSAVED_G,
        USE_INITIAL=p.initial_state is not None,
        USE_INITIAL_BIAS=p.initial_state_bias is not None, STORE_FINAL=p.output_final_state,
        IS_VARLEN=varlen, FUSE_OUT=fuse, SAVE=save, HALF=half, PREC=prec, **forms,
        **_launch("chain", BD, p.q.dtype, tune))
    out = None if fuse else dict(
        H=H, D=D, BT=BT, BS=_rows("S_out", BT, BD, G, p.q.dtype, tune), BD=BD, G=G,
        IS_VARLEN=varlen, HALF=half, PREC=prec, **forms,
        **_launch("local", BD, p.q.dtype, tune, BT=BT))
    return _kept(key, _ForwardSetup(grp, fuse, save, chain, out))


def _kept(key: tuple | None, setup: _ForwardSetup) -> _ForwardSetup:
    if key is not None:
        if len(_FORWARD_SETUPS) >= MAX_SETUPS:
            _FORWARD_SETUPS.clear()
        _FORWARD_SETUPS[key] = setup
    return setup


def _row_step_setup(p: Problem, BD: int) -> _ForwardSetup:
    """The setup of a short generation step (:func:`.tuning.row_step`): fwd_decode's
    arguments; no grouping, slots or outputs kernel."""
    decode = dict(
        H=p.H, D=p.D, BD=BD, USE_INITIAL=p.initial_state is not None,
        USE_INITIAL_BIAS=p.initial_state_bias is not None, STORE_FINAL=p.output_final_state,
        IS_VARLEN=p.cu_seqlens is not None, HAS_ETA_KEY=p.eta_key is not None,
        OUTPUT=p.output, **({} if kernels_interpreted() else decode_options(BD)))
    return _ForwardSetup(None, True, False, decode, None, row_step=True)


@_refusing_unfit_tunings
def ttt_linear_fwd(problem: Problem, save_for_backward: bool, *,
                   tuning: Tuning = DEFAULT_TUNING):
    """Returns (o, ht, hbt, saved); ht/hbt None unless output_final_state, saved None unless
    save_for_backward."""
    p = problem
    q, k, v, w, b, eta, cu_seqlens = p.q, p.k, p.v, p.w, p.b, p.eta, p.cu_seqlens
    B, T, H, D = q.shape
    N = p.N
    dev = q.device
    tune = _checked(tuning)
    setup = _forward_setup(p, save_for_backward, tune)
    grp = setup.grp
    ht = hbt = None
    if p.output_final_state:
        ht = torch.empty(N, H, D, D, dtype=torch.float32, device=dev)
        hbt = torch.empty(N, H, 1, D, dtype=torch.float32, device=dev)
    h0, hb0 = _initial_states(p)
    scale, eps, eta_key = float(p.scale), float(p.eps), p.eta_key
    if setup.row_step:
        o = torch.empty_like(q)
        launches_run([Launch(ttt_linear_fwd_decode_kernel, (N * H,), (
            q, k, v, eta, w, b, eta_key, o, h0, hb0, ht, hbt, cu_seqlens, scale, eps, T),
            setup.chain)], dev, "fwd", p)
        return o, ht, hbt, None
    ck = ckb = xbuf = rbuf = None
    if setup.save:
        ck = torch.empty(grp.slots, H, D, D, dtype=torch.float32, device=dev)
        ckb = torch.empty(grp.slots, H, D, dtype=torch.float32, device=dev)
        xbuf = torch.empty(q.shape, dtype=torch.float32, device=dev)
        rbuf = torch.empty(B, T, H, dtype=torch.float32, device=dev)
    o = torch.empty_like(q)
    launches = [Launch(ttt_linear_fwd_chain_kernel, (N * H,), (
        q, k, v, eta, w, b, eta_key, o, h0, hb0, ht, hbt, ck, ckb, xbuf, rbuf, cu_seqlens,
        grp.offsets, scale, eps, T), setup.chain)]
    if setup.out is not None:
        launches.append(Launch(ttt_linear_fwd_out_kernel, (grp.count, H), (
            q, k, v, eta, w, b, eta_key, ck, ckb, xbuf, rbuf, o, cu_seqlens, grp.offsets,
            grp.seq, scale, eps, T), setup.out))
    saved = Saved(ck, ckb, xbuf, rbuf, grp) if save_for_backward else None
    if saved is not None and not setup.backward_ahead:
        setup.backward_ahead = True           # (a setup kept: once per configuration)
        _prefetch_backward(p, saved, tune)
    launches_run(launches, dev, "fwd", p, setup.save, setup.fuse, tune)
    return o, ht, hbt, saved


@dataclass
class _BackwardPass:
    """A backward's launches, the flags of their pass key (:func:`.launches.pass_key`) and
    ``finish()``, the gradients once they ran."""

    launches: list[Launch]
    flags: tuple
    finish: Callable[[], tuple]


def _backward_pass(p: Problem, saved: Saved, do, dht, dhbt, tune: Tuning, needs: GradNeeds,
                   alloc: Callable[..., torch.Tensor]) -> _BackwardPass | None:
    """The backward of ``p`` (see :func:`ttt_linear_bwd`), its buffers from ``alloc`` (as
    ``torch.empty``); None when nothing is needed."""
    q, k, v, w, b, eta, cu_seqlens = p.q, p.k, p.v, p.w, p.b, p.eta, p.cu_seqlens
    eta_key = p.eta_key
    has_h0 = p.initial_state is not None or p.initial_state_bias is not None
    n_dq, n_dk, n_dv, n_dw, n_db = needs.q, needs.k, needs.v, needs.w, needs.b
    n_deta = needs.eta and p.eta_is_tensor
    n_dh0 = has_h0 and needs.initial_state
    n_dhb0 = has_h0 and needs.initial_state_bias
    n_dl = eta_key is not None and needs.eta_key
    n_grads = n_dk or n_dv or n_dw or n_db or n_deta     # bwd_grads' (or the fused chain's)
    n_chain = n_grads or n_dh0 or n_dhb0 or n_dl
    if not (n_dq or n_chain):
        return None
    B, T, H, D = q.shape
    N = p.N
    BT, BD = block_sizes(D, p.chunk_size)
    grp = saved.groups
    G = grp.G
    dev = q.device
    prec = dot_precision(q.dtype, BD)
    varlen = cu_seqlens is not None
    f32 = dict(dtype=torch.float32, device=dev)

    def empty(shape, needed, **like):
        return alloc(shape, **(like or f32)) if needed else None

    xbuf, rbuf = saved.xbuf, saved.rbuf
    dopbuf = empty(q.shape, n_chain)
    dgbuf = empty(q.shape, n_chain)
    dq = empty(q.shape, n_dq, dtype=q.dtype, device=dev)
    deta = empty((B, T, H, 1), n_deta)
    fuse = fused_backward(p, tune)          # bwd_grads' work done by the backward chain
    split = grads_split(q.dtype, BD, BT, tune)
    parts = 1 if fuse or not n_grads else 2
    dwp = empty((parts, grp.count, H, D), n_dw)
    dbp = empty((parts, grp.count, H, D), n_db)
    dwp0 = None if dwp is None else dwp[0]
    dbp0 = None if dbp is None else dbp[0]
    group_launch = _launch("group", BD, q.dtype, tune)
    local_launch = _launch("local", BD, q.dtype, tune, BT=BT)
    if group_launch and wide_backward(q.dtype, BD, BT):
        group_launch["num_stages"] = local_launch["num_stages"] = WIDE_BACKWARD["stages"]
    forms = dict(HAS_ETA_KEY=eta_key is not None)
    launches = [Launch(ttt_linear_bwd_local_kernel, (grp.count, H), (
        q, k, v, eta, w, b, do, eta_key, saved.ck, saved.ckb, xbuf, rbuf, dopbuf, dgbuf,
        dq, deta, dwp0, dbp0, cu_seqlens, grp.offsets, grp.seq,
        float(p.scale), float(p.eps), T), dict(
        H=H, D=D, BT=BT, BS=_rows("S_local", BT, BD, G, q.dtype, tune), BD=BD, G=G,
        IS_VARLEN=varlen, HALF=q.dtype != torch.float32, PREC=prec, **forms,
        OUTPUT=p.output, NEED_DQ=n_dq, NEED_DETA=n_deta, NEED_DW=n_dw, NEED_DB=n_db,
        STORE_BUFS=n_chain, **local_launch))]
    use_dht = n_chain and (dht is not None or dhbt is not None)
    fuse = n_chain and fuse
    dk = dv = dh0 = dhb0 = deta_key = dwc = dbc = None
    if n_chain:
        dh0 = empty((N, H, D, D), n_dh0)
        dhb0 = empty((N, H, 1, D), n_dhb0)
        deta_key = empty((B, T, H, 1), n_dl)
        if use_dht:
            dht = torch.zeros(N, H, D, D, **f32) if dht is None else dht.contiguous()
            dhbt = torch.zeros(N, H, 1, D, **f32) if dhbt is None else dhbt.contiguous()
        dk = empty(q.shape, n_dk, dtype=q.dtype, device=dev)
        dv = empty(q.shape, n_dv, dtype=q.dtype, device=dev)
        feed = n_grads and not fuse           # bwd_grads runs after the chain
        dck = desum = None
        if fuse:
            dwc = empty((N, H, D), n_dw)
            dbc = empty((N, H, D), n_db)
        else:
            dck = empty(saved.ck.shape, feed)
            desum = empty((B, T, H), n_deta)
        needs_flags = dict(NEED_DK=n_dk, NEED_DV=n_dv, NEED_DETA=n_deta, NEED_DW=n_dw,
                           NEED_DB=n_db)
        launches.append(Launch(ttt_linear_bwd_chain_kernel, (N * H,), (
            q, k, v, eta, w, b, eta_key, deta_key, xbuf, rbuf, dopbuf, dgbuf, desum, dht,
            dhbt, dck, dh0, dhb0, saved.ck, dk, dv, deta, dwc, dbc, cu_seqlens, grp.offsets,
            float(p.scale), T), dict(
            H=H, D=D, BT=BT, BD=BD, G=G, USE_DHT=use_dht, STORE_DH0=n_dh0,
            IS_VARLEN=varlen, FUSE_GRADS=fuse, PREC=prec, **forms, NEED_DETA_KEY=n_dl,
            STORE_DHB0=n_dhb0, **needs_flags, FEED_GRADS=feed,
            **_launch("chain", BD, q.dtype, tune, fused_bwd=fuse))))
        if feed:
            launches.append(Launch(ttt_linear_bwd_grads_kernel,
                                   (grp.count, H, split if n_dk else 1), (
                q, k, v, eta, w, b, eta_key, saved.ck, dck, xbuf, rbuf, dopbuf, dgbuf, desum,
                dk, dv, deta, None if dwp is None else dwp[1],
                None if dbp is None else dbp[1], cu_seqlens, grp.offsets, grp.seq,
                float(p.scale), T), dict(
                H=H, D=D, BT=BT, BS=_rows("S_grads", BT, BD, G, q.dtype, tune), BD=BD, G=G,
                IS_VARLEN=varlen, PREC=prec, SPLIT=split if n_dk else 1, **forms,
                **needs_flags, **group_launch)))

    def finish():
        if fuse:
            dw = None if dwp is None else dwp[0].sum(0) + dwc.sum(0)
            db = None if dbp is None else dbp[0].sum(0) + dbc.sum(0)
        else:
            dw, db = _reduced(dwp), _reduced(dbp)
        return Gradients(dq=dq, dk=dk, dv=dv, dw=dw, db=db, deta=deta, deta_key=deta_key,
                         dh0=dh0, dhb0=dhb0)

    return _BackwardPass(launches, (needs, use_dht, fuse, tune), finish)


@_refusing_unfit_tunings
def ttt_linear_bwd(problem: Problem, saved: Saved, do, dht, dhbt, *,
                   tuning: Tuning = DEFAULT_TUNING, needs: GradNeeds | None = None):
    """The :class:`ttt.Gradients`: dw/db [H, D] fp32, deta and deta_key [B, T, H, 1] fp32. Each is
    None where not needed: ``needs`` (a :class:`ttt.GradNeeds`, every gradient when None)
    does not ask for it, or it does not apply (dh0/dhb0 without initial states, deta of a
    float eta, deta_key without eta_key). Only the kernels, stores and buffers the needed
    ones take run or are allocated; each needed gradient comes from the same operations as in
    a backward that computes them all (bitwise equal under the interpreter; on a GPU the
    compiler may contract a multiply-add differently once unneeded code is gone). Every
    returned tensor is freshly allocated."""
    tune = _checked(tuning)
    bwd = _backward_pass(problem, saved, do, dht, dhbt, tune,
                         GradNeeds() if needs is None else needs, torch.empty)
    if bwd is None:
        return Gradients()
    launches_run(bwd.launches, problem.q.device, "bwd", problem, *bwd.flags)
    return bwd.finish()


def _placeholder(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` holding one element (stride 0): what a kernel's
    compile sees of an argument (its dtype and an aligned address), without the memory."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def _training_needs(p: Problem) -> GradNeeds:
    """The gradients a training step asks for: every input's that ``p`` has."""
    return GradNeeds(eta=p.eta_is_tensor, initial_state=p.initial_state is not None,
                     initial_state_bias=p.initial_state_bias is not None,
                     eta_key=p.eta_key is not None)


def _prefetch_backward(p: Problem, saved: Saved, tune: Tuning) -> None:
    """On a GPU, a forward that saves for a backward, the first of its configuration, starts
    compiling that backward's kernels in background threads (:func:`.launches.prefetch`)
    beside its own: the launches of a training step's backward (every gradient the inputs
    have, no final-state cotangents) built on placeholder tensors. A backward that needs
    other gradients compiles its own kernels on its first call."""
    needs = _training_needs(p)
    # the flags _backward_pass gives this backward (no cotangents; the chain needed): checked
    # before building it, which a packed batch's forward would otherwise do on every call
    if not launches_wants_prefetch("bwd", p, needs, False, fused_backward(p, tune), tune):
        return
    bwd = _backward_pass(p, saved, _placeholder(p.q.shape, p.q.dtype, p.q.device), None, None,
                         tune, needs, _placeholder)
    launches_prefetch(bwd.launches, p.q.device, "bwd", p, *bwd.flags)


def _reduced(partials: torch.Tensor | None) -> torch.Tensor | None:
    """dw or db [H, D] from its partials [parts, groups, H, D] (a fresh tensor)."""
    return None if partials is None else partials.sum((0, 1))
