"""The buffers of each pass and each kernel's arguments, in the order of its ``__global__``
signature (csrc/*.cu): raw addresses as numpy uint64, scalars as numpy float32 / int32 /
int64; the segment, the tail and the shared-memory size go last (:meth:`Kernel.launch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ttt import Problem
from ttt.chunking import ChunkGroups, group_count

Segment = tuple[int, int]
"""Group range [g_lo, g_hi) of each sequence; (0, 0): every group of the batch."""

NO_SYNC = np.uint64(0)
"""A chain kernel's ``sync`` argument when not overlapped (null)."""

PLAIN_GROUP = (NO_SYNC, np.int32(0), np.int64(0), np.int32(0))
"""A group kernel's (sync, mode, n_chains, wait_spins) when not overlapped (mode kPlain)."""


@dataclass(frozen=True)
class Kernel:
    """A kernel of a pass with its arguments up to the segment (built once per pass)."""

    fn: Any
    block: int
    smem: int
    args: tuple

    def launch(self, device, grid: int, segment: Segment, tail: tuple, stream) -> None:
        device.launch(self.fn, grid, self.block, self.smem,
                      (*self.args, np.int64(segment[0]), np.int64(segment[1]), *tail,
                       np.uint64(self.smem)), stream)


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


def shape_args(p: Problem, grp: ChunkGroups, eps: bool = True) -> tuple:
    B, T, H, D = p.q.shape
    return ((np.float32(p.scale),) + ((np.float32(p.eps),) if eps else ())
            + (np.int64(T), np.int32(H), np.int32(D), np.int32(grp.G)))


def fwd_chain_args(ptrs, p: Problem, grp: ChunkGroups, eta, w, b, h0, hb0, ht, hbt, ck, ckb,
                   xbuf, rbuf, o, ekey, rlbuf, scalars: tuple) -> tuple:
    """``ptrs``: the device's :meth:`~ttt_cupy.device.CudaDevice.pointers` (as every builder
    below takes it); ``scalars``: :func:`shape_args` of ``p`` and ``grp``."""
    return (*ptrs(p.q, p.k, p.v, eta, w, b, h0, hb0, ht, hbt, ck, ckb, xbuf, rbuf, o, ekey,
                  rlbuf, p.cu_seqlens, grp.offsets), *scalars)


def fwd_out_args(ptrs, p: Problem, grp: ChunkGroups, eta, w, b, ck, ckb, xbuf, rbuf,
                 o, scalars: tuple) -> tuple:
    return (*ptrs(p.q, p.k, p.v, eta, w, b, ck, ckb, xbuf, rbuf, o, p.cu_seqlens, grp.offsets,
                  grp.seq), *scalars)


def decode_scalars(p: Problem, rows: int, smem: int) -> tuple:
    """fwd_decode's arguments after its pointers: scale, eps, T, H, D, its rows and its
    shared memory in bytes (the last argument of every kernel)."""
    B, T, H, D = p.q.shape
    return (np.float32(p.scale), np.float32(p.eps), np.int64(T), np.int32(H), np.int32(D),
            np.int32(rows), np.uint64(smem))


def fwd_decode_args(ptrs, p: Problem, eta, w, b, ekey, h0, hb0, ht, hbt, o,
                    scalars: tuple) -> tuple:
    """``scalars``: :func:`decode_scalars`; eta, w, b, ekey in fp32 or all in the input
    dtype (the kernel's ``P``)."""
    return (*ptrs(p.q, p.k, p.v, eta, w, b, ekey, h0, hb0, ht, hbt, o, p.cu_seqlens),
            *scalars)


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


def bwd_local_args(ptrs, p: Problem, s: Saved, g: BackwardBuffers, do, scalars: tuple
                   ) -> tuple:
    eta, w, b = s.f32
    dwp, dbp = g.dwbp[0], g.dwbp[1]
    return (*ptrs(p.q, p.k, p.v, eta, w, b, do, s.ck, s.ckb, s.xbuf, s.rbuf, g.dopbuf,
                  g.dgbuf, g.dq, g.deta, dwp[0], dbp[0], p.cu_seqlens, s.groups.offsets,
                  s.groups.seq), *scalars)


def bwd_chain_args(ptrs, p: Problem, s: Saved, g: BackwardBuffers, dht, dhbt,
                   fused: bool, scalars: tuple) -> tuple:
    """The fused chain's also take the slots, dk, dv and the per-group dw, db partials."""
    eta, w, b = s.f32
    dwp, dbp = g.dwbp[0], g.dwbp[1]
    fused_tensors = (s.ck, g.dk, g.dv, dwp[1], dbp[1]) if fused else ()
    return (*ptrs(p.q, p.k, p.v, eta, w, b, s.xbuf, s.rbuf, g.dopbuf, g.dgbuf, g.deta, dht,
                  dhbt, g.dck, g.dckb, g.dh0, g.dhb0, s.rlbuf, g.dkey, *fused_tensors,
                  p.cu_seqlens, s.groups.offsets), *scalars)


def bwd_grads_args(ptrs, p: Problem, s: Saved, g: BackwardBuffers, scalars: tuple) -> tuple:
    eta, w, b = s.f32
    dwp, dbp = g.dwbp[0], g.dwbp[1]
    return (*ptrs(p.q, p.k, p.v, eta, w, b, s.ck, g.dck, s.xbuf, s.rbuf, g.dopbuf, g.dgbuf,
                  g.dk, g.dv, dwp[1], dbp[1], s.rlbuf, p.cu_seqlens, s.groups.offsets,
                  s.groups.seq), *scalars)
