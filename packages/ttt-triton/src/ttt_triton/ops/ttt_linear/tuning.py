"""Launch choices of the Triton kernels: the tables and rules per shape class, and
:class:`Tuning`, what a caller (a test, a benchmark sweep) may force instead.

The launcher asks the rules below for every choice: the checkpoint interval G, whether
the chains are fused, the rows per block of the group kernels, the split of bwd_grads and
the compiler options (num_warps, num_stages). A :class:`Tuning` passed to the launcher's
``tuning=`` keyword fixes any of them (the interpreter ignores the compiler options).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ttt import Problem, schedule
from ttt.chunking import group_count
from ttt.schedule import FuseThresholds

CKPT_INTERVAL = {"narrow": 16, "wide": 32, "wide_min_warps": 2048}
"""G: chunks per group. The forward chain stores the fp32 state every G chunks (slots);
the parallel kernels replay one group each from its slot. Longer groups mean fewer slots
and less per-group work; shorter ones more programs for the parallel kernels. So G is
"wide" (32) when the group kernels still launch at least ``wide_min_warps`` warps with it
(about 16 per SM of an H200), else "narrow" (16). On the H200 (docs/benchmarks.md) G = 32
is 1-4% faster on the four larger anchor shapes and 14% slower on 8,2048,12,64, the one
the rule leaves at 16."""

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
doubled for BD >= 128 or IEEE (float32) dots at BD >= 64 (and see :data:`IEEE_WIDE`)."""

IEEE_WIDE = {"rows": 32, "local_warps": 16}
"""Float32 inputs at a padded head dim of 128 or chunk 64, where the IEEE products (FMA
loops, :func:`dot_precision`) hold more operands than the registers: ptxas then keeps the
rest in local memory, KBs of stack per thread, and CUDA reserves that stack for every
thread the GPU can hold (stack x 2048 x SMs: 3 GB per process at 11 KB on an H100, kept
while the process lives; several processes sharing a GPU ran out of memory). So there:

- the group kernels take blocks of at most ``rows`` rows at head dim 128 (fwd_out at chunk
  16: 9.0 KB of stack with 64 rows, 0.4 KB with 32);
- fwd_out and bwd_local (the ``"local"`` kind of :func:`num_warps`) run ``local_warps``
  warps at chunk 64 (bwd_local at head dim 128: 10.9 KB with 8, 3.6 KB with 16; fwd_out at
  head dim 128 without eta_key: 8.9 KB with 8, 1.7 KB with 16);
- the forward chain is not fused (fused: 4.3-11.3 KB at head dim 128, 8.6 KB at chunk 64,
  head dim 64); a generation step longer than fwd_decode's rows runs fwd_chain and fwd_out.

The largest stack the rules then pick is 6.0 KB, 1.5 GiB reserved per process (bwd_local
at chunk 64, head dim 64, without eta_key; ``python -m tools.resources``, sm_90, triton 3.6;
ptxas's spilling moves with small changes of a kernel, so the sm_90 compile test bounds it:
``tests/sm90_compile.py``'s ``STACK_LIMIT``)."""

NUM_STAGES = {"chain_stages": 1, "chain_stages_fp32": 1, "fused_bwd_stages": 2,
              "group_stages": 2, "group_stages_fp32": 1}
"""num_stages (software pipelining of the loop's loads) of the sequential kernels, which
prefetch the next chunk by hand, and of the group-parallel ones; the ``*_fp32`` keys for
float32 inputs, the others for half inputs. For half inputs ``group_stages`` 2 is 0-10%
faster fwd+bwd than 1 on the five anchor shapes on the H200 (docs/benchmarks.md). Float32
keeps 1: with 2, ptxas compiles fwd_out at head dim 64 and bwd_local at chunk 64 into 32
registers and 5-8 KB of stack (``tools/resources.py``). ``fused_bwd_stages`` replaces
``chain_stages`` for the fused backward chain (see :data:`FUSED`; half inputs, chunk 16,
head dims <= 64): with 2, 32,2048,16,64 fwd+bwd takes 4.24 ms on the H200 against 4.48 with 1,
while the unfused chains spill with 2 at chunk 32 (bf16 D 64 bwd_chain: 488 B)."""

WIDE_BACKWARD = {"grads_split": 2, "stages": 1}
"""The backward at chunk 64 and a padded head dim of 128 with half inputs, where Triton's
tf32 dots stage fp32 operands in shared memory (``tools/resources.py``, sm_90, triton
3.6 as on the GPU runner; an H200 block has 227 KB): bwd_grads runs ``grads_split``
programs per (group, head), each with a share of the columns of k (the rows of the state and
of its cotangent), and bwd_local and bwd_grads run ``stages`` stages. bwd_local needs 230
KB with 2 stages, 197 KB with 1; bwd_grads 246 KB unsplit with 1 stage, 295 KB split with
2, 180 KB split with 1. Elsewhere bwd_grads runs one program per (group, head)."""

FUSED = FuseThresholds(forward_inference=96, forward_training=256, backward=256)
"""Fused chains (``ttt.schedule``): with at least this many (sequence, head) chains, the
forward chain writes the outputs itself (no ``fwd_out``; for a forward without backward
also no ``xhat``/``r``/slot stores), and the backward chain computes ``dk``, ``dv`` and the
last-row ``deta`` itself (no ``bwd_grads``); measured in docs/benchmarks.md. A generation
step (``ttt.schedule.generation_step``) is fused whatever the chain count: one launch
(``fwd_chain``) instead of two; the shortest run ``fwd_decode`` instead
(:data:`ROW_STEP_ROWS`)."""

_ROWS_FIELD = {"S_out": "rows_out", "S_local": "rows_local", "S_grads": "rows_grads"}


def _is_power_of_two(value) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value > 0
            and value & (value - 1) == 0)


@dataclass(frozen=True)
class Tuning:
    """Choices forced on the launcher (``ttt_linear_fwd`` / ``ttt_linear_bwd``'s
    ``tuning=``) instead of its rules, for tests and benchmark sweeps. Every field defaults
    to None: the rule or table named decides.

    - ``checkpoint_interval``: G, chunks per group (:data:`CKPT_INTERVAL`); a power of two.
      The forward's choice; the backward takes the forward's groups.
    - ``fuse_forward``: the forward chain writes the outputs (:data:`FUSED`); set either way,
      a generation step runs the chained kernels, never fwd_decode (:func:`row_step`).
    - ``fuse_backward``: the backward chain computes dk, dv, the last-row deta (:data:`FUSED`).
    - ``grads_split``: bwd_grads programs per (group, head), 1 or 2 (:data:`WIDE_BACKWARD`).
    - ``rows_out``, ``rows_local``, ``rows_grads``: rows per block of fwd_out, bwd_local,
      bwd_grads (:data:`BLOCK_ROWS`); powers of two >= 16, clamped to [one chunk, one group].
    - ``chain_warps``, ``group_warps``: num_warps of the chain / group kernels, as given
      (:data:`NUM_WARPS` and its doubling rule otherwise); 1, 2, 4, 8 or 16.
    - ``chain_stages``, ``group_stages``: num_stages of the chain / group kernels for every
      dtype (:data:`NUM_STAGES` otherwise; :data:`WIDE_BACKWARD`'s stages still apply to
      the backward's group kernels at its shapes); 1 to 8.
    """

    checkpoint_interval: int | None = None
    fuse_forward: bool | None = None
    fuse_backward: bool | None = None
    grads_split: int | None = None
    rows_out: int | None = None
    rows_local: int | None = None
    rows_grads: int | None = None
    chain_warps: int | None = None
    group_warps: int | None = None
    chain_stages: int | None = None
    group_stages: int | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if field.name in ("fuse_forward", "fuse_backward"):
                ok, expected = isinstance(value, bool), "None or a bool"
            elif field.name == "grads_split":
                ok = value in (1, 2) and not isinstance(value, bool)
                expected = "None, 1 or 2"
            elif field.name == "checkpoint_interval":
                ok, expected = _is_power_of_two(value), "None or a power of two"
            elif field.name.endswith("_warps"):
                ok, expected = value in (1, 2, 4, 8, 16), "None, 1, 2, 4, 8 or 16"
                ok = ok and not isinstance(value, bool)
            elif field.name.endswith("_stages"):
                ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 8
                expected = "None or an int from 1 to 8"
            else:
                ok = _is_power_of_two(value) and value >= 16
                expected = "None or a power of two >= 16"
            if not ok:
                raise ValueError(f"Tuning.{field.name}: expected {expected}, "
                                 f"got {value!r} ({type(value).__name__})")


DEFAULT_TUNING = Tuning()
"""Every choice by the rules: what the backend uses."""


def forced_fields(tune: Tuning) -> dict:
    """The fields ``tune`` forces (those not None)."""
    return {f.name: getattr(tune, f.name) for f in fields(tune)
            if getattr(tune, f.name) is not None}


def unfit_tuning_error(tune: Tuning, resource: str, required: int, limit: int) -> ValueError:
    """The error for a forced :class:`Tuning` whose kernels need more of ``resource`` (e.g.
    shared memory, in bytes per block) than the device has."""
    forced = ", ".join(f"{k}={v!r}" for k, v in forced_fields(tune).items())
    return ValueError(f"tuning: Tuning({forced}) needs {required} bytes of {resource} per "
                      f"block in one of its kernels, the device allows {limit}; force fewer "
                      f"stages (group_stages, chain_stages), fewer rows per block or a "
                      f"smaller grads_split")


def block_sizes(D: int, chunk_size: int) -> tuple[int, int]:
    """(BT, BD): the chunk, and the head dim padded to a power of two, at least 16."""
    return chunk_size, max(16, 1 << (D - 1).bit_length())


def ieee_wide(ieee: bool, BD: int, BT: int) -> bool:
    """Whether float32 (IEEE) products at ``BD``, ``BT`` take :data:`IEEE_WIDE`'s rules."""
    return ieee and (BD >= 128 or BT >= 64)


def _table_kind(kind: str) -> str:
    """The kind whose tables and Tuning fields a ``kind`` kernel takes ("local": "group")."""
    return "group" if kind == "local" else kind


def num_warps(kind: str, BD: int, ieee: bool, tune: Tuning = DEFAULT_TUNING,
              BT: int = 16) -> int:
    """num_warps of a ``kind`` kernel: "chain", "group", or "local" (fwd_out, bwd_local: group
    kernels but for :data:`IEEE_WIDE`); :data:`NUM_WARPS`."""
    group = _table_kind(kind)
    forced = getattr(tune, f"{group}_warps")
    if forced is not None:
        return forced
    if kind == "local" and ieee and BT >= 64:
        return IEEE_WIDE["local_warps"]
    warps = NUM_WARPS[group]
    if BD >= 128 or (ieee and BD >= 64):
        warps = min(2 * warps, 8)
    return warps


def launch_options(kind: str, BD: int, ieee: bool, tune: Tuning,
                   fused_bwd: bool = False, BT: int = 16) -> dict:
    """num_warps and num_stages of a ``kind`` ("chain", "group" or "local") kernel,
    ``fused_bwd`` for the backward chain that does bwd_grads' work: what the launcher passes
    on a GPU and ``tools/resources.py`` compiles with."""
    group = _table_kind(kind)
    stages = getattr(tune, f"{group}_stages")
    if stages is None:
        if ieee:
            stages = NUM_STAGES[f"{group}_stages_fp32"]
        else:
            stages = NUM_STAGES["fused_bwd_stages" if fused_bwd else f"{group}_stages"]
    return dict(num_warps=num_warps(kind, BD, ieee, tune, BT), num_stages=stages)


def checkpoint_interval(p: Problem, BD: int, tune: Tuning) -> int:
    """G for ``p``: the forced value if set, else the rule of :data:`CKPT_INTERVAL`."""
    if tune.checkpoint_interval is not None:
        return tune.checkpoint_interval
    wide = CKPT_INTERVAL["wide"]
    warps = num_warps("group", BD, p.dtype == torch.float32, tune)
    if group_count(p, wide) * p.H * warps >= CKPT_INTERVAL["wide_min_warps"]:
        return wide
    return CKPT_INTERVAL["narrow"]


DECODE_WARPS = {"max_state_per_thread": 32}
"""num_warps of fwd_decode: enough threads that each holds at most this many fp32 entries of
each [BD, BD] tile it keeps in registers (the state and the update so far), up to 8 warps: 4
at BD 64, 8 at BD 128."""


ROW_STEP_ROWS = {"half": 1, "fp32": 4, "fp32_wide": 16}
"""The most rows of one sequence that a generation step (``ttt.schedule.generation_step``)
runs through
fwd_decode, one row at a time, instead of the fused chain's chunk products: for half inputs,
and float32 ones at padded head dims <= 64 and at 128 (``fp32_wide``). fwd_decode reads and
writes the state once, but its per-row work grows with the rows, while the chain's products
cost one padded chunk whatever the rows. On an H100 (B 64, H 16, layer form, CUDA graph
replay, us per call, fwd_decode / fused chain): bf16 D 64 15.1 / 24.4 at 1 row, 33.4 / 25.1
at 4; fp32 D 64 14.3 / 64.4 at 1 row, 37.8 / 66.5 at 4, 132 / 70 at 16; fp32 D 128 549 /
1969 at 16 rows (``tools/row_step.py`` measures it)."""


def row_step(p: Problem, save_for_backward: bool, tune: Tuning) -> bool:
    """Whether ``p``'s forward runs fwd_decode alone (``ttt.schedule.row_step``): a
    generation step of at most :data:`ROW_STEP_ROWS` rows per sequence, the chained kernels
    not forced (``tune.fuse_forward``)."""
    if p.q.dtype != torch.float32:
        rows = ROW_STEP_ROWS["half"]
    else:
        rows = ROW_STEP_ROWS["fp32_wide" if p.D > 64 else "fp32"]
    return schedule.row_step(p, save_for_backward, rows, tune.fuse_forward)


def decode_options(BD: int) -> dict:
    """fwd_decode's compiler options (:data:`DECODE_WARPS`)."""
    warps = BD * BD // (32 * DECODE_WARPS["max_state_per_thread"])
    return dict(num_warps=min(8, max(1, warps)), num_stages=1)


def fused_forward(p: Problem, save_for_backward: bool, tune: Tuning) -> bool:
    """Whether the forward chain writes the outputs (``ttt.schedule.fuse_forward`` with
    :data:`FUSED`): forced, else never under :data:`IEEE_WIDE`, else for a generation step
    or enough chains."""
    BT, BD = block_sizes(p.D, p.chunk_size)
    if tune.fuse_forward is None and ieee_wide(p.q.dtype == torch.float32, BD, BT):
        return False
    return schedule.fuse_forward(p, save_for_backward, FUSED, tune.fuse_forward)


def fused_backward(p: Problem, tune: Tuning) -> bool:
    """Whether the backward chain computes dk, dv and the last-row deta (see :data:`FUSED`).
    Only chosen for chunk 16 and head dims <= 64, where it was measured: larger tiles
    spill more (``tools/resources.py``)."""
    if tune.fuse_backward is None and not (p.chunk_size == 16 and p.D <= 64):
        return False
    return schedule.fuse_backward(p, FUSED, tune.fuse_backward)


def wide_backward(dtype: torch.dtype, BD: int, BT: int) -> bool:
    """Whether the backward takes :data:`WIDE_BACKWARD`'s settings."""
    return dtype != torch.float32 and BD >= 128 and BT >= 64


def grads_split(dtype: torch.dtype, BD: int, BT: int, tune: Tuning) -> int:
    """Programs per (group, head) of bwd_grads (:data:`WIDE_BACKWARD`). A split program's
    products have BD / 2 columns, which tl.dot needs to be at least 16."""
    split = tune.grads_split
    if split is None:
        return WIDE_BACKWARD["grads_split"] if wide_backward(dtype, BD, BT) else 1
    if split > 1 and BD // split < 16:
        raise ValueError(f"Tuning.grads_split: {split} needs a padded head dim of at least "
                         f"{16 * split}, got {BD}")
    return split


def rows_per_block(kind: str, BT: int, G: int, tune: Tuning, *, BD: int, ieee: bool) -> int:
    """Rows per block of fwd_out (``kind="S_out"``), bwd_local (``"S_local"``) or bwd_grads
    (``"S_grads"``): forced, else :data:`BLOCK_ROWS` (at most :data:`IEEE_WIDE`'s rows for
    float32 at head dim 128); clamped to [BT, G * BT]."""
    rows = getattr(tune, _ROWS_FIELD[kind])
    if rows is None:
        rows = BLOCK_ROWS[kind]
        if ieee and BD >= 128:
            rows = min(rows, IEEE_WIDE["rows"])
    return max(BT, min(rows, G * BT))


def dot_precision(dtype: torch.dtype, BD: int) -> str:
    """The kernels' PREC (``common.mm``): HALF_DOT_PRECISION for half inputs; IEEE for
    float32, as K blocks of 16 ("ieee_kblocks") at a padded head dim of 128, where plain IEEE
    dots put the kernels into local memory. On the H200, 4,4096,8,128 fp32 fwd+bwd took 60.4
    ms with the blocks against 113 ms without, and 4,4096,16,64 7.93 against 5.95 ms, so
    head dims <= 64 keep plain IEEE dots (docs/benchmarks.md)."""
    if dtype != torch.float32:
        return HALF_DOT_PRECISION
    return "ieee_kblocks" if BD >= 128 else "ieee"
