"""Launchers: allocate outputs with torch, launch the CUDA kernels through CuPy (zero copy).

Kernels get raw ``data_ptr()`` addresses and run on torch's current stream of the inputs'
device; nothing is copied to the host. Tunables live in :data:`CKPT_INTERVAL`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ttt import Problem

from .compile import d_pad, get_kernels, smem_bytes, threads

CKPT_INTERVAL = 8
"""G: the forward stores the fp32 state before every G-th chunk; the backward recomputes the
G states of a group into a per-block scratch of G states (as the Triton backend)."""

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).contiguous()


def max_smem_optin(device: torch.device) -> int | None:
    """The device's opt-in shared memory per block in bytes (None when torch does not say)."""
    props = torch.cuda.get_device_properties(device)
    value = getattr(props, "shared_memory_per_block_optin", None)
    return int(value) if value else None


def smem_reason(D: int, chunk_size: int, backward: bool, limit: int | None) -> str | None:
    """Why the kernels of this shape do not fit the device's shared memory (None: they do)."""
    if limit is None:
        return None
    dp = d_pad(D)
    kinds = ("fwd", "bwd") if backward else ("fwd",)
    for kind in kinds:
        need = smem_bytes(kind, dp, chunk_size)
        if need > limit:
            what = "backward" if kind == "bwd" else "forward"
            return (f"the cupy {what} kernel for head dim {D} (padded {dp}) and chunk_size "
                    f"{chunk_size} needs {need // 1024} KiB of shared memory; this device "
                    f"allows {limit // 1024} KiB per block (use a smaller chunk_size)")
    return None


@dataclass
class Saved:
    """What the forward keeps for the backward: the fp32 checkpoints and their offsets."""

    ck: torch.Tensor                  # [NCK, H, D, D] fp32
    ckb: torch.Tensor                 # [NCK, H, D] fp32
    ck_offsets: torch.Tensor | None   # [N + 1] int64 (varlen only)
    G: int


@functools.cache
def _device_smem_limit(index: int) -> int:
    import cupy

    runtime = cupy.cuda.runtime
    attr = getattr(runtime, "cudaDevAttrMaxSharedMemoryPerBlockOptin", 97)  # CUDA's enum value
    return int(runtime.deviceGetAttribute(attr, index))


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _launch(kernel, device: torch.device, grid: int, block: int, smem: int, args: tuple) -> None:
    """Launch ``kernel`` on torch's current stream of ``device`` with ``smem`` bytes of dynamic
    shared memory (opting in above 48 KiB)."""
    import cupy

    if grid == 0:
        return
    index = _index(device)
    with cupy.cuda.Device(index):
        limit = _device_smem_limit(index)
        if smem > limit:
            raise RuntimeError(f"the cupy kernel needs {smem} bytes of shared memory; the "
                               f"device allows {limit} per block")
        if kernel.max_dynamic_shared_size_bytes < smem:
            kernel.max_dynamic_shared_size_bytes = smem
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:
            kernel((grid,), (block,), args, shared_mem=smem)


def ttt_linear_fwd(problem: Problem, save_for_backward: bool):
    """Returns (o, ht, hbt, saved); ht/hbt None unless output_final_state, saved None unless
    save_for_backward."""
    p = problem
    q, k, v, w, b, eta = p.q, p.k, p.v, p.w, p.b, p.eta
    h0, hb0, cu_seqlens = p.initial_state, p.initial_state_bias, p.cu_seqlens
    output_final_state = p.output_final_state
    if q.dtype not in _DTYPE_NAMES:
        raise TypeError(f"the cupy kernels take float32, float16 and bfloat16, got {q.dtype}")
    B, T, H, D = q.shape
    N = p.N
    BT, dp = p.chunk_size, d_pad(D)
    G = CKPT_INTERVAL
    dev = q.device
    o = torch.empty_like(q)
    ht = hbt = None
    if output_final_state:
        ht = torch.empty(N, H, D, D, dtype=torch.float32, device=dev)
        hbt = torch.empty(N, H, 1, D, dtype=torch.float32, device=dev)
    ck = ckb = ck_offsets = None
    if save_for_backward:
        offs = p.group_offsets(G)
        ck = torch.empty(offs[-1], H, D, D, dtype=torch.float32, device=dev)
        ckb = torch.empty(offs[-1], H, D, dtype=torch.float32, device=dev)
        if cu_seqlens is not None:
            ck_offsets = torch.tensor(offs, dtype=torch.int64).to(dev, non_blocking=True)
    eta32, w32, b32 = _f32(eta), _f32(w), _f32(b)
    h0, hb0 = _f32(h0), _f32(hb0)

    fwd, _ = get_kernels(_DTYPE_NAMES[q.dtype], dp, BT, _index(dev))
    smem = smem_bytes("fwd", dp, BT)
    args = (_ptr(q), _ptr(k), _ptr(v), _ptr(eta32), _ptr(w32), _ptr(b32), _ptr(h0), _ptr(hb0),
            _ptr(o), _ptr(ht), _ptr(hbt), _ptr(ck), _ptr(ckb), _ptr(cu_seqlens),
            _ptr(ck_offsets), np.float32(p.scale), np.float32(p.eps), np.int64(T), np.int32(H),
            np.int32(D), np.int32(G), np.uint64(smem))
    _launch(fwd, dev, N * H, threads(dp), smem, args)
    saved = Saved(ck, ckb, ck_offsets, G) if save_for_backward else None
    return o, ht, hbt, saved


def ttt_linear_bwd(problem: Problem, saved: Saved, do, dht, dhbt):
    """Returns (dq, dk, dv, dw, db, deta, dh0, dhb0); dw/db [H, D] fp32, deta [B, T, H, 1]
    fp32, dh0/dhb0 None without initial states."""
    p = problem
    q, k, v, w, b, eta, cu_seqlens = p.q, p.k, p.v, p.w, p.b, p.eta, p.cu_seqlens
    want_dh0 = p.initial_state is not None or p.initial_state_bias is not None
    if saved is None:
        raise RuntimeError("the cupy backward needs the checkpoints of a forward run with "
                           "needs_backward=True")
    B, T, H, D = q.shape
    N = p.N
    BT, dp = p.chunk_size, d_pad(D)
    G = saved.G
    dev = q.device
    # per-block scratch of SG = min(G, chunks of the longest sequence) states
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
    dht, dhbt = _f32(dht), _f32(dhbt)
    do = do.contiguous()
    eta32, w32, b32 = _f32(eta), _f32(w), _f32(b)

    _, bwd = get_kernels(_DTYPE_NAMES[q.dtype], dp, BT, _index(dev))
    smem = smem_bytes("bwd", dp, BT)
    args = (_ptr(q), _ptr(k), _ptr(v), _ptr(eta32), _ptr(w32), _ptr(b32), _ptr(do),
            _ptr(dht), _ptr(dhbt), _ptr(saved.ck), _ptr(saved.ckb), _ptr(scr), _ptr(scrb),
            _ptr(dq), _ptr(dk), _ptr(dv), _ptr(deta), _ptr(dh0), _ptr(dhb0), _ptr(dwp),
            _ptr(dbp), _ptr(cu_seqlens), _ptr(saved.ck_offsets), np.float32(p.scale),
            np.float32(p.eps), np.int64(T), np.int32(H), np.int32(D), np.int32(G), np.int32(SG),
            np.uint64(smem))
    _launch(bwd, dev, N * H, threads(dp), smem, args)
    dw = dwp.sum(0)
    db = dbp.sum(0)
    return dq, dk, dv, dw, db, deta, dh0, dhb0
