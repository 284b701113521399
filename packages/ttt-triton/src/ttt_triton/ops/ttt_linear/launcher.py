"""Launchers: allocate outputs, pick block sizes and launch the forward / backward kernels.

Tunables live in :data:`CKPT_INTERVAL`, :data:`FUSED`, :data:`HALF_DOT_PRECISION`,
:data:`NUM_WARPS`, :data:`NUM_STAGES`, :data:`MAX_REGISTERS` (:func:`tunables` applies
``TTT_TRITON_TUNE`` overrides).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from ttt import Problem
from ttt.chunking import ChunkGroups, group_offsets

from ...backend import interpreting
from .bwd_chain import ttt_linear_bwd_chain_kernel
from .bwd_grads import ttt_linear_bwd_grads_kernel
from .bwd_local import ttt_linear_bwd_local_kernel
from .fwd_chain import ttt_linear_fwd_chain_kernel
from .fwd_out import ttt_linear_fwd_out_kernel

# ---------------------------------------------------------------- tunables, in one place
CKPT_INTERVAL = {"narrow": 16, "wide": 32, "wide_min_warps": 2048}
"""G: chunks per group. The forward chain stores the fp32 state every G chunks (slots);
the parallel kernels replay one group each from its slot. Longer groups mean fewer slots
and less per-group work; shorter ones more programs for the parallel kernels. So G is
"wide" (32) when the group kernels still launch at least ``wide_min_warps`` warps with it
(about 16 per SM of an H200), else "narrow" (16). On the H200 (docs/benchmarks.md) G = 32
was 1-4% faster on the four larger anchor shapes and 14% slower on 8,2048,12,64, the one
it leaves at 16. ``TTT_TRITON_TUNE="G=8"`` fixes G."""

HALF_DOT_PRECISION = "tf32"
"""input_precision of the dots on fp32 tiles (the state, g, cotangents) for fp16/bf16
inputs; q k^T of half inputs is a half-precision dot with fp32 accumulation. float32
inputs use IEEE dots (:func:`dot_precision`)."""

BLOCK_ROWS = {"S_out": 64, "S_local": 32, "S_grads": 32}
"""Rows per block of fwd_out, bwd_local and bwd_grads, which walk a group in blocks of
S / BT chunks with masked [S, S] products (clamped to at least one chunk, at most one
group)."""

NUM_WARPS = {"chain": 4, "group": 4}
"""num_warps of the sequential kernels (fwd_chain, bwd_chain) and of the group-parallel
ones (fwd_out, bwd_local, bwd_grads), for padded head dims <= 64 with half inputs;
doubled for BD >= 128 or IEEE (float32) dots at BD >= 64."""

NUM_STAGES = {"chain_stages": 1, "chain_stages_fp32": 1, "fused_bwd_stages": 2,
              "group_stages": 2, "group_stages_fp32": 1}
"""num_stages (software pipelining of the loop's loads) of the sequential kernels, which
prefetch the next chunk by hand, and of the group-parallel ones; the ``*_fp32`` keys for
float32 inputs, the others for half inputs. For half inputs ``group_stages`` 2 was 0-10%
faster fwd+bwd than 1 on the five anchor shapes on the H200 once the backward kernels
spilled less (docs/benchmarks.md, 2026-12-03 third session). Float32 keeps 1: with 2,
ptxas compiles fwd_out at head dim 64 and bwd_local at chunk 64 into 32 registers and 5-8
KB of stack (``benchmarks/resources.py``). ``fused_bwd_stages`` replaces ``chain_stages``
for the fused backward chain (see :data:`FUSED`; half inputs, chunk 16, head dims <= 64):
2 took 32,2048,16,64 fwd+bwd from 4.48 to 4.24 ms on the H200, while the unfused chains
spill with 2 at chunk 32 (bf16 D 64 bwd_chain: 488 B)."""


WIDE_BACKWARD = {"grads_split": 2, "stages": 1}
"""The backward at chunk 64 and a padded head dim of 128 with half inputs, where Triton's
tf32 dots stage fp32 operands in shared memory (``benchmarks/resources.py``, sm_90, triton
3.6 as on the GPU runner; an H200 block has 227 KB): bwd_grads runs ``grads_split``
programs per (group, head), each with a share of the columns of k (the rows of the state and
of its cotangent), and bwd_local and bwd_grads run ``stages`` stages. bwd_local needs 230
KB with 2 stages, 197 KB with 1; bwd_grads 246 KB unsplit with 1 stage, 295 KB split with
2, 180 KB split with 1. Elsewhere bwd_grads runs one program per (group, head)
(``TTT_TRITON_TUNE="grads_split=2"`` forces the split, for tests)."""

MAX_REGISTERS = {"chain_regs": 0, "group_regs": 0}
"""Register cap per thread (ptx ``.maxnreg``; 0: none, the compiler's choice) of the
sequential and the group-parallel kernels. A cap lets more programs share an SM at the
price of spills."""


FUSED = {"forward_inference": 96, "forward_training": 256, "backward": 256}
"""Fused chains: with at least this many (sequence, head) chains, the forward chain writes
the outputs itself (no ``fwd_out``; for a forward without backward also no ``xhat``/``r``/
slot stores), and the backward chain computes ``dk``, ``dv`` and the last-row ``deta``
itself (no ``bwd_grads``). Fusing puts the parallel kernels' work on the chains' critical
path, which only pays when enough chains run at once to hide it (docs/benchmarks.md).
``TTT_TRITON_TUNE="fuse=1,fuse_bwd=0"`` forces either on (1) or off (0)."""


def tunables() -> dict[str, int]:
    """G (0: chosen per problem, see :func:`checkpoint_interval`), FUSED's overrides (-1:
    the rule), BLOCK_ROWS, NUM_WARPS, NUM_STAGES and MAX_REGISTERS, overridden for tuning
    runs by
    ``TTT_TRITON_TUNE="chain=2,G=8,S_out=32"``."""
    tune = dict(NUM_WARPS, G=0, fuse=-1, fuse_bwd=-1, grads_split=0, **BLOCK_ROWS,
                **NUM_STAGES, **MAX_REGISTERS)
    for item in filter(None, os.environ.get("TTT_TRITON_TUNE", "").split(",")):
        key, _, value = item.partition("=")
        tune[key.strip()] = int(value)
    return tune


def num_warps(kind: str, BD: int, ieee: bool, tune: dict[str, int] | None = None) -> int:
    warps = (tune or tunables())[kind]
    if BD >= 128 or (ieee and BD >= 64):
        warps = min(2 * warps, 8)
    return warps
# ----------------------------------------------------------------------------------------


def checkpoint_interval(p: Problem, BD: int, tune: dict[str, int]) -> int:
    """G for ``p``: the tuned value if set, else the rule of :data:`CKPT_INTERVAL`."""
    if tune["G"]:
        return tune["G"]
    wide = CKPT_INTERVAL["wide"]
    warps = num_warps("group", BD, p.dtype == torch.float32, tune)
    if group_offsets(p, wide)[-1] * p.H * warps >= CKPT_INTERVAL["wide_min_warps"]:
        return wide
    return CKPT_INTERVAL["narrow"]


def fused_forward(p: Problem, save_for_backward: bool, tune: dict[str, int]) -> bool:
    """Whether the forward chain writes the outputs (see :data:`FUSED`)."""
    if tune["fuse"] >= 0:
        return bool(tune["fuse"])
    return p.N * p.H >= FUSED["forward_training" if save_for_backward else "forward_inference"]


def fused_backward(p: Problem, tune: dict[str, int]) -> bool:
    """Whether the backward chain computes dk, dv and the last-row deta (see :data:`FUSED`).
    Only chosen for chunk 16 and head dims <= 64, where it was measured: larger tiles
    spill more (``benchmarks/resources.py``)."""
    if tune["fuse_bwd"] >= 0:
        return bool(tune["fuse_bwd"])
    return p.chunk_size == 16 and p.D <= 64 and p.N * p.H >= FUSED["backward"]


def wide_backward(dtype: torch.dtype, BD: int, BT: int) -> bool:
    """Whether the backward takes :data:`WIDE_BACKWARD`'s settings."""
    return dtype != torch.float32 and BD >= 128 and BT >= 64


def grads_split(dtype: torch.dtype, BD: int, BT: int, tune: dict[str, int]) -> int:
    """Programs per (group, head) of bwd_grads (:data:`WIDE_BACKWARD`)."""
    if tune["grads_split"]:
        return tune["grads_split"]
    return WIDE_BACKWARD["grads_split"] if wide_backward(dtype, BD, BT) else 1


def block_sizes(D: int, chunk_size: int) -> tuple[int, int]:
    return chunk_size, max(16, triton.next_power_of_2(D))


def rows_per_block(kind: str, BT: int, G: int, tune: dict[str, int]) -> int:
    """Rows per block of fwd_out (``kind="S_out"``), bwd_local (``"S_local"``) or bwd_grads
    (``"S_grads"``), clamped to [BT, G * BT]."""
    return max(BT, min(tune[kind], G * BT))


def dot_precision(dtype: torch.dtype, BD: int) -> str:
    """The kernels' PREC (``common.mm``): HALF_DOT_PRECISION for half inputs; IEEE for
    float32, as K blocks of 16 ("ieee_kblocks") at a padded head dim of 128, where plain IEEE
    dots put the kernels into local memory. On the H200, 4,4096,8,128 fp32 fwd+bwd took 60.4
    ms with the blocks against 113 ms without, and 4,4096,16,64 7.93 against 5.95 ms, so
    head dims <= 64 keep plain IEEE dots (docs/benchmarks.md)."""
    if dtype != torch.float32:
        return HALF_DOT_PRECISION
    return "ieee_kblocks" if BD >= 128 else "ieee"


def launch_options(kind: str, BD: int, ieee: bool, tune: dict[str, int],
                   fused_bwd: bool = False) -> dict:
    """num_warps, num_stages and (when capped) maxnreg of a ``kind`` ("chain" or "group")
    kernel, ``fused_bwd`` for the backward chain that does bwd_grads' work: what the launcher
    passes and ``benchmarks/resources.py`` compiles with."""
    if ieee:
        stages = f"{kind}_stages_fp32"
    else:
        stages = "fused_bwd_stages" if fused_bwd else f"{kind}_stages"
    options = dict(num_warps=num_warps(kind, BD, ieee, tune), num_stages=tune[stages])
    if tune[f"{kind}_regs"]:
        options["maxnreg"] = tune[f"{kind}_regs"]
    return options


def _launch(kind: str, BD: int, dtype: torch.dtype, tune: dict[str, int],
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
        """The backend interface's ``saved``: the tensors, in :func:`saved_shapes`' order."""
        return [self.ck, self.ckb, self.xbuf, self.rbuf]

    @classmethod
    def of(cls, p: Problem, tensors: list[torch.Tensor]) -> Saved:
        """Back from :meth:`tensors`; the grouping is the forward's, derived from ``p``."""
        ck, ckb, xbuf, rbuf = tensors
        return cls(ck, ckb, xbuf, rbuf, ChunkGroups.of(p, chunks_per_group(p)))


def chunks_per_group(p: Problem) -> int:
    """G of ``p``'s forward (:func:`checkpoint_interval` with today's tunables)."""
    return checkpoint_interval(p, block_sizes(p.D, p.chunk_size)[1], tunables())


def saved_shapes(p: Problem) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of :meth:`Saved.tensors` of a forward of ``p`` with a backward."""
    slots = group_offsets(p, chunks_per_group(p))[-1] + p.N
    B, T, H, D = p.q.shape
    return [((slots, H, D, D), torch.float32), ((slots, H, D), torch.float32),
            ((B, T, H, D), torch.float32), ((B, T, H), torch.float32)]


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


def ttt_linear_fwd(problem: Problem, save_for_backward: bool):
    """Returns (o, ht, hbt, saved); ht/hbt None unless output_final_state, saved None unless
    save_for_backward."""
    p = problem
    q, k, v, w, b, eta, cu_seqlens = p.q, p.k, p.v, p.w, p.b, p.eta, p.cu_seqlens
    B, T, H, D = q.shape
    N = p.N
    BT, BD = block_sizes(D, p.chunk_size)
    dev = q.device
    tune = tunables()
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


def ttt_linear_bwd(problem: Problem, saved: Saved, do, dht, dhbt):
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
    tune = tunables()
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
