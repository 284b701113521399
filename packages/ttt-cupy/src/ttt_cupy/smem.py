"""Threads and shared memory of every kernel instance, from the C++ ``Traits``
(csrc/traits.cuh) through the generated :mod:`ttt_cupy._traits_table`."""

from __future__ import annotations

import functools

from ._traits_table import FIELDS, TRAITS
from .compile import (
    BLOCK_TS,
    FUSED_BWD_MAX_D_PAD,
    FUSED_KERNEL,
    KERNELS,
    PASSES,
    REGISTER_STATE_KERNELS,
    d_pad,
)

_TRAITS = {key: dict(zip(FIELDS, row)) for key, row in TRAITS.items()}


def traits(dp: int, bt: int) -> dict[str, int]:
    """The Traits<dp, bt> members of the table (e.g. ``kBwdGradsBytes``)."""
    if (dp, bt) not in _TRAITS:
        raise ValueError(f"(D_PAD, BT): expected one of {sorted(_TRAITS)}, got {(dp, bt)}")
    return _TRAITS[(dp, bt)]


def traits_field(kernel: str, tc: bool = False, fused: bool = False) -> str:
    """The Traits member of ``kernel``'s shared memory, e.g. kFwdChainFusedTcBytes."""
    name = "".join(part.capitalize() for part in kernel.split("_"))
    return f"k{name}{'Fused' if fused else ''}{'Tc' if tc else ''}Bytes"


def threads(dp: int, kernel: str | None = None, mma: bool = False) -> int:
    """Threads per block: kThreads, or kTcThreads for the chains' tensor-core instances."""
    return traits(dp, 16)["kTcThreads" if mma and kernel in REGISTER_STATE_KERNELS
                          else "kThreads"]


def grads_split(dp: int, bt: int) -> int:
    """Blocks per (group, head) of bwd_grads."""
    return traits(dp, bt)["kGradsSplit"]


@functools.cache
def smem_bytes(kernel: str, dp: int, bt: int, mma: bool = False, fused: bool = False) -> int:
    """Dynamic shared memory of one block of ``kernel``'s instance, in bytes."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if fused and kernel != FUSED_KERNEL:
        raise ValueError(f"fused: only {FUSED_KERNEL} has fused instances, not {kernel!r}")
    return traits(dp, bt)[traits_field(kernel, mma and kernel != "bwd_grads", fused)]


def bwd_chain_fused_smem_bytes(dp: int, bt: int) -> int:
    """Dynamic shared memory of the fused backward chain."""
    if dp > FUSED_BWD_MAX_D_PAD:
        raise ValueError(f"D_PAD: the fused backward chain needs at most {FUSED_BWD_MAX_D_PAD}, "
                         f"got {dp}")
    return traits(dp, bt)["kBwdChainFusedTcBytes"]


def decode_threads(dp: int) -> int:
    return traits(dp, 16)["kDecThreads"]


def decode_rows(longest: int) -> int:
    """The rows a fwd_decode launch holds for a longest sequence of ``longest`` rows: a power of
    two (at least 1), so that steps of about the same length share one setup."""
    return 1 << max(0, longest - 1).bit_length()


def decode_smem_bytes(dp: int, rows: int) -> int:
    """Dynamic shared memory of a fwd_decode block holding ``rows`` rows (kDecRowBytes each)."""
    return rows * traits(dp, 16)["kDecRowBytes"]


def pass_smem(pass_: str, dp: int, bt: int) -> tuple[str, int]:
    """(kernel, bytes) of the pass's kernel instance that needs the most shared memory."""
    if pass_ not in PASSES:
        raise ValueError(f"pass: expected one of {tuple(PASSES)}, got {pass_!r}")
    return max(((k, max(smem_bytes(k, dp, bt, mma, fused) for mma in (False, True)
                        for fused in {False, k == FUSED_KERNEL}))
                for k in PASSES[pass_]), key=lambda kv: kv[1])


@functools.lru_cache(maxsize=1024)
def smem_reason(D: int, chunk_size: int, backward: bool, limit: int | None) -> str | None:
    """Why this shape's kernels do not fit ``limit`` bytes of shared memory per block (None:
    they do, or no limit is known). Cached: the backend asks at every call."""
    if limit is None:
        return None
    dp = d_pad(D)
    passes = ("fwd", "bwd") if backward else ("fwd",)
    for pass_ in passes:
        kernel, need = pass_smem(pass_, dp, chunk_size)
        if need > limit:
            smaller = [bt for bt in BLOCK_TS if bt < chunk_size
                       and all(pass_smem(q, dp, bt)[1] <= limit for q in passes)]
            hint = (f"chunk_size {max(smaller)} fits" if smaller
                    else f"no chunk_size fits head dim {D} here")
            return (f"the cupy {'backward' if pass_ == 'bwd' else 'forward'} kernel {kernel} "
                    f"for head dim {D} (padded {dp}) and chunk_size {chunk_size} needs "
                    f"{need // 1024} KiB of shared memory; this device allows {limit // 1024} "
                    f"KiB per block ({hint})")
    return None
