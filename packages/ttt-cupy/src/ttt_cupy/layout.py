"""The buffers of each pass and its kernels' argument struct (:mod:`ttt_cupy.params`, packed
once per pass; :meth:`Kernel.launch` sets the segment, the overlapped pass's fields and the
shared memory of each launch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ttt import Problem
from ttt.chunking import ChunkGroups, group_count

from .params import BwdParams, DecodeParams, FwdParams, Params

Segment = tuple[int, int]
"""Group range [g_lo, g_hi) of each sequence; (0, 0): every group of the batch."""

@dataclass(frozen=True)
class Kernel:
    """A kernel of a pass with its argument struct (packed once per pass)."""

    fn: Any
    block: int
    smem: int
    params: Params

    def launch(self, device, grid: int, segment: Segment, stream, **fields) -> None:
        """``fields``: the overlapped pass's sync, mode, n_chains, wait_spins (else 0)."""
        device.launch(self.fn, grid, self.block, self.smem,
                      self.params.at(g_lo=segment[0], g_hi=segment[1], smem_bytes=self.smem,
                                     **fields), stream)


def group_blocks(grp: ChunkGroups, N: int, segment: Segment) -> int:
    """(group, head) blocks per head of a group kernel over ``segment``."""
    g_lo, g_hi = segment
    return grp.count if g_hi <= g_lo else N * (g_hi - g_lo)


def f32(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t if t.dtype == torch.float32 else t.to(torch.float32)).contiguous()


@dataclass
class Saved:
    """What the forward keeps for the backward: the fp32 state slots, the LayerNorm's xhat and
    g's factor r of every row (fwd_chain; with eta_key l r, and the LayerNorm's r in rlbuf)
    and the grouping."""

    ck: torch.Tensor          # [slots, H, D, D] fp32
    ckb: torch.Tensor         # [slots, H, D] fp32
    xbuf: torch.Tensor        # [B, T, H, D] fp32 xhat
    rbuf: torch.Tensor        # [B, T, H] fp32 r (with eta_key: l r)
    groups: ChunkGroups
    f32: tuple                # eta, w, b as the kernels read them (fp32, contiguous)
    rlbuf: torch.Tensor | None = None   # [B, T, H] fp32 the LayerNorm's r (eta_key only)
    ekey: torch.Tensor | None = None    # eta_key as the kernels read it (fp32), or None

    def tensors(self, p: Problem) -> list[torch.Tensor]:
        """The backend interface's ``saved``: the tensors, in :func:`saved_shapes`' order
        (rlbuf with eta_key, a packed batch's group offsets and group -> sequence map, and the
        fp32 casts of eta, w, b (and eta_key) that are not the inputs themselves: nothing is
        copied or cast again)."""
        grouping = [] if self.groups.offsets is None else [self.groups.offsets, self.groups.seq]
        values = dict(zip(_CAST, (*self.f32, self.ekey)))
        casts = [values[name] for name in _cast_names(p)]
        key = [] if self.rlbuf is None else [self.rlbuf]
        return [self.ck, self.ckb, self.xbuf, self.rbuf, *key, *grouping, *casts]

    @classmethod
    def of(cls, p: Problem, tensors: list[torch.Tensor], ckpt_interval: int) -> Saved:
        """Back from :meth:`tensors`; the grouping's counts derived from ``p``."""
        ck, ckb, xbuf, rbuf, *rest = tensors
        rlbuf = None
        if p.eta_key is not None:
            rlbuf, *rest = rest
        grouping, casts = (rest[:2], rest[2:]) if p.is_varlen else ([], rest)
        groups = ChunkGroups.of(p, ckpt_interval, tuple(grouping) or None)
        cast = dict(zip(_cast_names(p), casts))
        return cls(ck, ckb, xbuf, rbuf, groups,
                   tuple(cast.get(name, getattr(p, name)) for name in _CAST[:3]), rlbuf,
                   cast.get("eta_key", p.eta_key))


_CAST = ("eta", "w", "b", "eta_key")
"""The inputs the kernels read in fp32 (:attr:`Saved.f32`, :attr:`Saved.ekey`)."""


def _cast_names(p: Problem) -> list[str]:
    """Those of :data:`_CAST` that :func:`f32` casts into new tensors (Problem tensors are
    contiguous: the fp32 ones go to the kernels as they are)."""
    return [name for name in _CAST
            if getattr(p, name) is not None and getattr(p, name).dtype != torch.float32]


def saved_shapes(p: Problem, ckpt_interval: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of :meth:`Saved.tensors` of a forward of ``p`` with a backward."""
    count = group_count(p, ckpt_interval)
    B, T, H, D = p.q.shape
    key = [((B, T, H), torch.float32)] if p.eta_key is not None else []
    grouping = [((p.N + 1,), torch.int64), ((count,), torch.int32)] if p.is_varlen else []
    casts = [(tuple(getattr(p, name).shape), torch.float32) for name in _cast_names(p)]
    return [((count + p.N, H, D, D), torch.float32), ((count + p.N, H, D), torch.float32),
            ((B, T, H, D), torch.float32), ((B, T, H), torch.float32), *key, *grouping, *casts]


def fwd_params(p: Problem, grp: ChunkGroups, eta, w, b, h0, hb0, ht, hbt, ck, ckb, xbuf,
               rbuf, o, ekey, rlbuf) -> FwdParams:
    """The forward's struct (fwd_chain, fwd_out): eta, w, b, ekey in fp32."""
    B, T, H, D = p.q.shape
    return FwdParams(q=p.q, k=p.k, v=p.v, eta=eta, lnw=w, lnb=b, h0=h0, hb0=hb0, ht=ht,
                     hbt=hbt, ck=ck, ckb=ckb, xbuf=xbuf, rbuf=rbuf, o=o, ekey=ekey, rlbuf=rlbuf,
                     cu_seqlens=p.cu_seqlens, grp_offsets=grp.offsets, grp_seq=grp.seq, T_len=T,
                     scale=p.scale, eps=p.eps, H=H, D=D, G=grp.G)


def decode_params(p: Problem, eta, w, b, ekey, h0, hb0, ht, hbt, o, rows: int,
                  smem: int) -> DecodeParams:
    """fwd_decode's struct: eta, w, b, ekey in fp32 or all in the input dtype (the kernel's
    ``P``); shared memory for ``rows`` rows (``smem`` bytes)."""
    B, T, H, D = p.q.shape
    return DecodeParams(q=p.q, k=p.k, v=p.v, eta=eta, lnw=w, lnb=b, ekey=ekey, h0=h0, hb0=hb0,
                        ht=ht, hbt=hbt, o=o, cu_seqlens=p.cu_seqlens, T_len=T, smem_bytes=smem,
                        scale=p.scale, eps=p.eps, H=H, D=D, rows=rows)


@dataclass
class BackwardBuffers:
    """The backward's outputs and work buffers (fp32 but dq, dk, dv). None: not computed
    (dk, dv without bwd_grads' work; dh0, dhb0 without an initial state that needs them;
    dkey without eta_key or its need)."""

    dopbuf: torch.Tensor     # [B, T, H, D] do_pre
    dgbuf: torch.Tensor      # [B, T, H, D] dg_loc, then the full dg
    dq: torch.Tensor
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    deta: torch.Tensor       # [B, T, H, 1]
    dwbp: torch.Tensor       # [2, 2, groups, H, D]: dw, db partials of bwd_local, bwd_grads
    dh0: torch.Tensor | None  # [N, H, D, D]
    dhb0: torch.Tensor | None  # [N, H, 1, D]
    dck: torch.Tensor        # the slots' cotangents (bwd_chain -> bwd_grads)
    dckb: torch.Tensor       # (of hb: a segment's start, bwd_chain only)
    dkey: torch.Tensor | None = None  # [B, T, H, 1] deta_key

    @classmethod
    def of(cls, p: Problem, saved: Saved, want_dh0: bool, grads: bool = True,
           want_dkey: bool = False) -> BackwardBuffers:
        """``grads``: bwd_grads' work runs (dk, dv allocated)."""
        q = p.q
        B, T, H, D = q.shape
        f = dict(dtype=torch.float32, device=q.device)
        dopbuf, dgbuf = torch.empty(q.shape, **f), torch.empty(q.shape, **f)
        dq = torch.empty_like(q)
        deta = torch.empty(B, T, H, 1, **f)
        dwbp = torch.empty(2, 2, saved.groups.count, H, D, **f)
        dh0 = torch.empty(p.N, H, D, D, **f) if want_dh0 else None
        dhb0 = torch.empty(p.N, H, 1, D, **f) if want_dh0 else None
        dck, dckb = torch.empty_like(saved.ck), torch.empty_like(saved.ckb)
        dk, dv = (torch.empty_like(q), torch.empty_like(q)) if grads else (None, None)
        dkey = torch.empty(B, T, H, 1, **f) if want_dkey else None
        return cls(dopbuf, dgbuf, dq, dk, dv, deta, dwbp, dh0, dhb0, dck, dckb, dkey)


def bwd_params(p: Problem, s: Saved, g: BackwardBuffers, do, dht, dhbt) -> BwdParams:
    """The backward's struct (bwd_local, bwd_chain, its fused instance, bwd_grads)."""
    B, T, H, D = p.q.shape
    eta, w, b = s.f32
    dwp, dbp = g.dwbp[0], g.dwbp[1]
    return BwdParams(q=p.q, k=p.k, v=p.v, dout=do, eta=eta, lnw=w, lnb=b, ck=s.ck, ckb=s.ckb,
                     xbuf=s.xbuf, rbuf=s.rbuf, rlbuf=s.rlbuf, dopbuf=g.dopbuf, dgbuf=g.dgbuf,
                     dq=g.dq, dk=g.dk, dv=g.dv, deta=g.deta, dwp_local=dwp[0], dbp_local=dbp[0],
                     dwp=dwp[1], dbp=dbp[1], dht=dht, dhbt=dhbt, dck=g.dck, dckb=g.dckb,
                     dh0=g.dh0, dhb0=g.dhb0, dkey=g.dkey, cu_seqlens=p.cu_seqlens,
                     grp_offsets=s.groups.offsets, grp_seq=s.groups.seq, T_len=T,
                     scale=p.scale, eps=p.eps, H=H, D=D, G=s.groups.G)
