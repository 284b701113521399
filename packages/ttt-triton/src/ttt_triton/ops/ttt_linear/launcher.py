"""Launchers: allocate outputs, pick block sizes and launch the forward / backward kernels.

Tunables live in :data:`CKPT_INTERVAL`, :func:`num_warps` and :func:`num_stages`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from ttt import Problem

from .bwd import ttt_linear_bwd_kernel
from .fwd import ttt_linear_fwd_kernel

# ---------------------------------------------------------------- tunables, in one place
CKPT_INTERVAL = 8
"""G: the forward stores the fp32 state before every G-th chunk; the backward recomputes the
G states of a group into a per-program scratch of G states."""

HALF_DOT_PRECISION = "tf32"
"""input_precision of the dots for fp16/bf16 inputs (operands are fp32 tiles: the state is
kept in fp32). float32 inputs always use "ieee"."""


def num_warps(BD: int, backward: bool, ieee: bool = False) -> int:
    """Measured on an H200, triton 3.6, chunk 16 (fwd / fwd+bwd ms):
    D=64 bf16 B*H=512: 4 warps 0.98/5.6 (8: 1.9/7.8); D=64 bf16 B*H=16 T=32k: 4 warps
    6.9/32.4 (8: 7.8/31.2); D=128 bf16: 8 warps 0.82/6.0 (4: 1.3/10.3); D=64 fp32 (IEEE
    dots): 8 warps 3.0/19 (4: 24/51). 1 and 2 warps were always worse. BD <= 32 untuned."""
    if BD >= 128 or (ieee and BD >= 64):
        return 8
    return 4


def num_stages(BD: int, backward: bool) -> int:
    return 1


def prefetch() -> bool:
    """Forward: load the next chunk's tiles one step early (register double buffering).
    Off by default: checked in the interpreter only, not yet timed nor conformance-tested on
    a GPU; ``TTT_TRITON_PREFETCH=1`` turns it on for that."""
    return os.environ.get("TTT_TRITON_PREFETCH", "0") == "1"
# ----------------------------------------------------------------------------------------


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def block_sizes(D: int, chunk_size: int) -> tuple[int, int]:
    return chunk_size, max(16, triton.next_power_of_2(D))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else HALF_DOT_PRECISION


def _launch_kwargs(BD: int, backward: bool, dtype: torch.dtype) -> dict:
    if interpreting():
        return {}
    return dict(num_warps=num_warps(BD, backward, dtype == torch.float32),
                num_stages=num_stages(BD, backward))


@dataclass
class Saved:
    """What the forward keeps for the backward: the fp32 checkpoints and their offsets."""

    ck: torch.Tensor          # [NCK, H, D, D] fp32
    ckb: torch.Tensor         # [NCK, H, D] fp32
    ck_offsets: torch.Tensor | None  # [N + 1] int64 (varlen only)
    G: int


def ttt_linear_fwd(problem: Problem, save_for_backward: bool):
    """Returns (o, ht, hbt, saved); ht/hbt None unless output_final_state, saved None unless
    save_for_backward."""
    p = problem
    q, k, v, w, b, eta = p.q, p.k, p.v, p.w, p.b, p.eta
    h0, hb0, cu_seqlens = p.initial_state, p.initial_state_bias, p.cu_seqlens
    output_final_state = p.output_final_state
    B, T, H, D = q.shape
    N = p.N
    BT, BD = block_sizes(D, p.chunk_size)
    G = CKPT_INTERVAL
    dev = q.device
    o = torch.empty_like(q)
    ht = hbt = None
    if output_final_state:
        ht = torch.empty(N, H, D, D, dtype=torch.float32, device=dev)
        hbt = torch.empty(N, H, 1, D, dtype=torch.float32, device=dev)
    offs = p.group_offsets(G)
    # the varlen kernel reads its sequence's checkpoint offset whether or not it saves
    ck_offsets = None
    if cu_seqlens is not None:
        ck_offsets = torch.tensor(offs, dtype=torch.int64).to(dev, non_blocking=True)
    if save_for_backward:
        ck = torch.empty(offs[-1], H, D, D, dtype=torch.float32, device=dev)
        ckb = torch.empty(offs[-1], H, D, dtype=torch.float32, device=dev)
    else:
        ck = ckb = None
    if h0 is not None:
        h0 = h0.float().contiguous()
    if hb0 is not None:
        hb0 = hb0.float().contiguous()
    if h0 is not None and hb0 is None:
        hb0 = torch.zeros(N, H, 1, D, dtype=torch.float32, device=dev)
    if hb0 is not None and h0 is None:
        h0 = torch.zeros(N, H, D, D, dtype=torch.float32, device=dev)

    ttt_linear_fwd_kernel[(N * H,)](
        q, k, v, eta, w, b, h0, hb0, o, ht, hbt, ck, ckb, cu_seqlens, ck_offsets,
        float(p.scale), float(p.eps), T,
        H=H, D=D, BT=BT, BD=BD, G=G,
        USE_INITIAL=h0 is not None, STORE_FINAL=output_final_state,
        SAVE_CKPT=save_for_backward, IS_VARLEN=cu_seqlens is not None,
        PREC=_precision(q.dtype), PREFETCH=prefetch(), **_launch_kwargs(BD, False, q.dtype))
    saved = Saved(ck, ckb, ck_offsets, G) if save_for_backward else None
    return o, ht, hbt, saved


def ttt_linear_bwd(problem: Problem, saved: Saved, do, dht, dhbt):
    """Returns (dq, dk, dv, dw, db, deta, dh0, dhb0); dw/db [H, D] fp32, deta [B, T, H, 1]
    fp32, dh0/dhb0 None without initial states."""
    p = problem
    q, k, v, w, b, eta, cu_seqlens = p.q, p.k, p.v, p.w, p.b, p.eta, p.cu_seqlens
    want_dh0 = p.initial_state is not None or p.initial_state_bias is not None
    B, T, H, D = q.shape
    N = p.N
    BT, BD = block_sizes(D, p.chunk_size)
    G = saved.G
    dev = q.device
    # per-program scratch of SG = min(G, chunks of the longest sequence) states
    SG = min(G, max(p.chunk_counts()))
    scr = torch.empty(N * H, SG, D, D, dtype=torch.float32, device=dev)
    scrb = torch.empty(N * H, SG, D, dtype=torch.float32, device=dev)
    dq = torch.empty_like(q)
    dk = torch.empty_like(q)
    dv = torch.empty_like(q)
    deta = torch.empty(B, T, H, 1, dtype=torch.float32, device=dev)
    dh0 = dhb0 = None
    if want_dh0:
        dh0 = torch.empty(N, H, D, D, dtype=torch.float32, device=dev)
        dhb0 = torch.empty(N, H, 1, D, dtype=torch.float32, device=dev)
    dwp = torch.empty(N, H, D, dtype=torch.float32, device=dev)
    dbp = torch.empty(N, H, D, dtype=torch.float32, device=dev)
    use_dht = dht is not None or dhbt is not None
    if use_dht:
        if dht is None:
            dht = torch.zeros(N, H, D, D, dtype=torch.float32, device=dev)
        if dhbt is None:
            dhbt = torch.zeros(N, H, 1, D, dtype=torch.float32, device=dev)
        dht = dht.contiguous()
        dhbt = dhbt.contiguous()

    ttt_linear_bwd_kernel[(N * H,)](
        q, k, v, eta, w, b, do, dht, dhbt, saved.ck, saved.ckb, scr, scrb,
        dq, dk, dv, deta, dh0, dhb0, dwp, dbp, cu_seqlens, saved.ck_offsets,
        float(p.scale), float(p.eps), T, SG,
        H=H, D=D, BT=BT, BD=BD, G=G,
        USE_DHT=use_dht, STORE_DH0=want_dh0, IS_VARLEN=cu_seqlens is not None,
        PREC=_precision(q.dtype), **_launch_kwargs(BD, True, q.dtype))
    dw = dwp.sum(0)
    db = dbp.sum(0)
    return dq, dk, dv, dw, db, deta, dh0, dhb0
