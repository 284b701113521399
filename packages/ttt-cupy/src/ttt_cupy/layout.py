"""What the forward saves for the backward (:class:`Saved`), as the backend interface's list of
tensors of known shapes (:func:`saved_shapes`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ttt import Problem
from ttt.chunking import ChunkGroups, group_count

from .placement import CKPT_INTERVAL


def f32(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t if t.dtype == torch.float32 else t.to(torch.float32)).contiguous()


@dataclass
class Saved:
    """The fp32 state slots, every row's xhat and g's factor r (with eta_key l r, and the
    LayerNorm's r in rlbuf), the grouping and the fp32 eta, w, b (and eta_key)."""

    ck: torch.Tensor          # [slots, H, D, D] fp32
    ckb: torch.Tensor         # [slots, H, D] fp32
    xbuf: torch.Tensor        # [B, T, H, D] fp32 xhat
    rbuf: torch.Tensor        # [B, T, H] fp32 r (with eta_key: l r)
    groups: ChunkGroups
    f32: tuple                # eta, w, b as the kernels read them (fp32, contiguous)
    rlbuf: torch.Tensor | None = None   # [B, T, H] fp32 the LayerNorm's r (eta_key only)
    ekey: torch.Tensor | None = None    # eta_key as the kernels read it (fp32), or None

    def tensors(self, p: Problem) -> list[torch.Tensor]:
        """The backend interface's ``saved``, in :func:`saved_shapes`' order (with the fp32
        casts of eta, w, b, eta_key that are not the inputs themselves)."""
        grouping = [] if self.groups.offsets is None else [self.groups.offsets, self.groups.seq]
        values = dict(zip(_CAST, (*self.f32, self.ekey)))
        casts = [values[name] for name in _cast_names(p)]
        key = [] if self.rlbuf is None else [self.rlbuf]
        return [self.ck, self.ckb, self.xbuf, self.rbuf, *key, *grouping, *casts]

    @classmethod
    def of(cls, p: Problem, tensors: list[torch.Tensor]) -> Saved:
        """Back from :meth:`tensors`; the grouping's counts derived from ``p``."""
        ck, ckb, xbuf, rbuf, *rest = tensors
        rlbuf = None
        if p.eta_key is not None:
            rlbuf, *rest = rest
        grouping, casts = (rest[:2], rest[2:]) if p.is_varlen else ([], rest)
        groups = ChunkGroups.of(p, CKPT_INTERVAL, tuple(grouping) or None)
        cast = dict(zip(_cast_names(p), casts))
        return cls(ck, ckb, xbuf, rbuf, groups,
                   tuple(cast.get(name, getattr(p, name)) for name in _CAST[:3]), rlbuf,
                   cast.get("eta_key", p.eta_key))


_CAST = ("eta", "w", "b", "eta_key")
"""The inputs the kernels read in fp32 (:attr:`Saved.f32`, :attr:`Saved.ekey`)."""


def _cast_names(p: Problem) -> list[str]:
    """Those of :data:`_CAST` that :func:`f32` casts into new tensors (not fp32)."""
    return [name for name in _CAST
            if getattr(p, name) is not None and getattr(p, name).dtype != torch.float32]


def saved_shapes(p: Problem) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of :meth:`Saved.tensors` of a forward of ``p`` with a backward."""
    count = group_count(p, CKPT_INTERVAL)
    B, T, H, D = p.q.shape
    key = [((B, T, H), torch.float32)] if p.eta_key is not None else []
    grouping = [((p.N + 1,), torch.int64), ((count,), torch.int32)] if p.is_varlen else []
    casts = [(tuple(getattr(p, name).shape), torch.float32) for name in _cast_names(p)]
    return [((count + p.N, H, D, D), torch.float32), ((count + p.N, H, D), torch.float32),
            ((B, T, H, D), torch.float32), ((B, T, H), torch.float32), *key, *grouping, *casts]
