"""The TTT-MLP launchers: the forward (one launch of :mod:`.fwd_chain`'s kernel, one program
per (sequence, head); for a generation step of one token per sequence, :mod:`.fwd_decode`'s,
or, in a CUDA graph where the chains are fewer than the SMs, its three split launches)
and the backward (one launch of :mod:`.bwd_chain`'s), as the custom ops
``ttt_triton::ttt_mlp_fwd`` and ``ttt_triton::ttt_mlp_bwd``, the first differentiable
through the second (``torch.library.register_autograd``): ``torch.compile`` and CUDA graphs
see opaque calls, autograd the usual graph."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from ttt import schedule
from ttt._custom_op import eager_and_plain
from ttt.problem import MlpProblem, state_shapes

from ..._env import kernels_interpreted
from ..ttt_linear.launches import Launch
from ..ttt_linear.tuning import block_sizes, dot_precision
from .bwd_chain import ttt_mlp_bwd_chain_kernel
from .fwd_chain import ttt_mlp_fwd_chain_kernel
from .fwd_decode import (
    ttt_mlp_fwd_decode_kernel,
    ttt_mlp_step_out_kernel,
    ttt_mlp_step_update_kernel,
    ttt_mlp_step_z2_kernel,
)


def num_warps(BD: int, BT: int) -> int:
    """Warps per program. The chunk's [BT, BD] tiles (about a dozen in the backward) stay live
    over the hidden walks: 8 warps up to BT * BD = 2048, 16 above."""
    return 8 if BT * BD <= 2048 else 16


BACKWARD_MAX_TILE = 64 * 64
"""The largest chunk tile ``BT * BD`` the backward takes: its shared memory grows with the
tile (at 64 x 64, 192 KiB in bf16; at 64 x 128, 256 KiB in bf16, more than the 227 KiB an
sm_90 block may have, and 220 KiB in float32), so chunk 64 at padded head dim 128 runs
forward only (the backend refuses training there)."""


def backward_fits(D: int, chunk_size: int) -> bool:
    """Whether the backward's kernel fits a GPU block at head dim ``D``, ``chunk_size``."""
    BT, BD = block_sizes(D, chunk_size)
    return BT * BD <= BACKWARD_MAX_TILE


CHECKPOINT_EVERY = 16
"""G: chunks between two of the forward's checkpoint slots (a forward for the backward). The
backward recomputes a group's states from its slot into G scratch slots per chain."""


def hidden_block(BD: int, *, backward: bool = False, half: bool = False,
                 chunk_size: int = 16) -> int:
    """Hidden columns (of W1; rows of W2) per block of the state the kernels stream: 32 at a
    padded head dim up to 64, 16 above (the [BD, BF] and [BF, BD] blocks in registers).

    The backward on half inputs at chunk 16 and padded head dim 64 or 128 takes twice as
    many: fewer, longer walks (H100, bf16 fwd+bwd: 4,4096,16,64 59.4 -> 48.5 ms, 2,2048,8,128
    129 -> 97 ms). With float32 tiles the doubled block spills (4,4096,16,64: 144 -> 566 ms);
    smaller head dims and longer chunks keep the forward's block (not measured)."""
    block = 32 if BD <= 64 else 16
    doubled = backward and half and chunk_size == 16 and BD >= 64
    return 2 * block if doubled else block


STEP_ROWS = 1
"""The most rows of a sequence the generation step's kernel (:mod:`.fwd_decode`) takes; a
longer step runs the chain (``ttt.schedule.row_step``)."""

STEP_MAX_BD = 64
"""The largest padded head dim whose generation steps run the one-launch step kernel: at
128 the chain's padded chunk was faster (H100, bf16, B 4, H 16: eager 207 against 214 us, in
a CUDA graph 173 against 189). A step split over programs (:func:`step_splits`) takes any."""

STEP_TILE = 64 * 64
"""Entries of each state block ([BD, BF], [BF, BD] fp32) the step's kernel holds in registers
at once, over its 8 warps: 16 per thread each. Twice that spills at padded head dims 64 and
128 (sm_90, ``tests/sm90_compile.py``), with 8 warps or 16."""


class StepSetup(NamedTuple):
    """A generation step's kernel arguments that are not tensors, per :func:`step_setup`
    key: the one-launch kernel's constexprs and options, and the three split kernels'."""

    whole: dict
    z2: dict
    update: dict
    out: dict


@functools.lru_cache(maxsize=256)
def step_setup(H: int, D: int, hidden: int, varlen: bool, key: bool, output: str,
               use_initial: bool, interpreted: bool) -> StepSetup:
    """The step kernels' constexprs and options (:data:`STEP_TILE`; two stages: the next
    hidden block's loads go out by cp.async while one is computed), made once per key."""
    BD = block_sizes(D, 16)[1]
    BF = max(16, min(STEP_TILE // BD, triton.next_power_of_2(hidden)))
    options = {} if interpreted else {"num_warps": 8, "num_stages": 2}
    whole = dict(H=H, D=D, BD=BD, BF=BF, IS_VARLEN=varlen, HAS_ETA_KEY=key, OUTPUT=output,
                 USE_INITIAL=use_initial, **options)

    def only(kernel, **kernel_options) -> dict:
        names = set(kernel.arg_names) | {"num_warps", "num_stages"}
        return {**{k: v for k, v in whole.items() if k in names}, **kernel_options}

    out = {} if interpreted else {"num_warps": 4, "num_stages": 1}
    return StepSetup(whole, only(ttt_mlp_step_z2_kernel), only(ttt_mlp_step_update_kernel),
                     only(ttt_mlp_step_out_kernel, **out))


def step_splits(chains: int, blocks: int, sms: int | None) -> int:
    """Programs per (sequence, head) of a generation step's walks over its ``blocks`` hidden
    blocks, on a GPU of ``sms`` SMs (None: not a GPU), in a CUDA graph. 1, one launch of the
    whole step, where the chains fill the SMs; fewer chains split the blocks over enough
    programs to give each SM two, one block or more each, in three launches
    (:func:`_split_launches`): a chain's state streams through one SM otherwise, its blocks
    one after another. Eager calls take one launch whatever the chains: their host time per
    launch exceeds the step's time on the GPU (:func:`_step`)."""
    if sms is None or chains >= sms:
        return 1
    return max(1, min(blocks, triton.cdiv(2 * sms, chains)))


def capturing() -> bool:
    """Whether a CUDA graph captures the current stream."""
    return torch.cuda.is_current_stream_capturing()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_launches(q, k, v, eta, w, b, eta_key, o, initial, final, cu_seqlens, scale, eps,
                    hidden, chains, splits, setup: StepSetup) -> list[Launch]:
    """A generation step in three launches, the hidden units split ``splits`` ways: the
    splits' ``X_2 W_2`` (:func:`.fwd_decode.ttt_mlp_step_z2_kernel`), then each split's
    update and share of the output, then the output."""
    BD, BF, T = setup.whole["BD"], setup.whole["BF"], q.shape[1]
    FS = triton.cdiv(triton.cdiv(hidden, BF), splits) * BF       # hidden units per split
    S = triton.cdiv(hidden, FS)
    scratch = q.new_empty(chains * (2 * S * BD + BD + S), dtype=torch.float32)
    z2_part, z_part, g2, m_part = scratch.split(     # (each 16-byte aligned, as Triton
        [chains * S * BD, chains * S * BD, chains * BD, chains * S])   # specializes on it)
    return [
        Launch(ttt_mlp_step_z2_kernel, (chains, S), (
            q, k, v, eta, eta_key, *initial[:3], final[1], z2_part, cu_seqlens, T, hidden,
            FS), setup.z2),
        Launch(ttt_mlp_step_update_kernel, (chains, S), (
            q, k, v, eta, w, b, eta_key, *initial, *final, z2_part, z_part, m_part, g2,
            cu_seqlens, scale, eps, T, hidden, FS), setup.update),
        Launch(ttt_mlp_step_out_kernel, (chains,), (
            q, k, v, eta, w, b, eta_key, o, initial[3], z_part, m_part, g2, cu_seqlens, eps,
            T, S), setup.out)]


_SPLITS_LOADED: set = set()
"""The steps (:func:`_step`'s keys) whose split launches are loaded on their device."""


def split_loaded(key: tuple) -> bool:
    """Whether an eager step of ``key`` (:func:`_step`) loaded the split launches."""
    return key in _SPLITS_LOADED


def _step(q, k, v, eta, w, b, eta_key, o, state, final, cu_seqlens, scale, eps, hidden,
          N, output) -> bool:
    """A generation step's launches: in a CUDA graph capture, the split ones where
    :func:`step_splits` says, else :mod:`.fwd_decode`'s whole-step kernel up to
    :data:`STEP_MAX_BD` (False past it: the chain's). A capture may not load a module, so
    an eager step that a capture would split compiles and loads the split launches (once
    per dtypes, constexprs and device), and a capture takes them only where one did: after
    the usual eager warm-up calls of the same shapes."""
    step = (q.shape[2], q.shape[3], hidden, cu_seqlens is not None, eta_key is not None,
            output, bool(state), kernels_interpreted())
    setup = step_setup(*step)
    chains, initial = N * q.shape[2], state or final
    sms = _sm_count(q.device.index) if q.device.type == "cuda" else None
    splits = step_splits(chains, triton.cdiv(hidden, setup.whole["BF"]), sms)
    if splits > 1:
        key = (step, q.device, q.dtype, eta.dtype, w.dtype, b.dtype,   # (k, v: q's dtype)
               None if eta_key is None else eta_key.dtype)
        split = (q, k, v, eta, w, b, eta_key, o, initial, final, cu_seqlens, scale, eps, hidden,
                 chains, splits, setup)
        in_capture, loaded = capturing(), split_loaded(key)
        if in_capture and loaded:
            for launch in _split_launches(*split):
                run_launch(launch)
            return True
        if not in_capture and not loaded:
            for launch in _split_launches(*split):
                launch.compile(q.device, load=True)
            _SPLITS_LOADED.add(key)
    if setup.whole["BD"] > STEP_MAX_BD:
        return False
    run_launch(Launch(ttt_mlp_fwd_decode_kernel, (chains,), (
        q, k, v, eta, w, b, eta_key, o, *initial, *final, cu_seqlens, scale, eps, q.shape[1],
        hidden), setup.whole))
    return True


def _state_shapes(q: Tensor, N: int, F: int) -> tuple[tuple[int, ...], ...]:
    return state_shapes(N, q.shape[2], q.shape[3], F)


def _constants(q: Tensor, chunk_size: int, hidden: int, cu_seqlens, eta_key,
               output: str, backward: bool = False) -> dict:
    """The constexprs and options of the forward's chain kernel, or the backward's."""
    H, D = q.shape[2], q.shape[3]
    BT, BD = block_sizes(D, chunk_size)
    half = q.dtype != torch.float32
    options = {} if kernels_interpreted() else {"num_warps": num_warps(BD, chunk_size)}
    block = hidden_block(BD, backward=backward, half=half, chunk_size=chunk_size)
    BF = min(block, max(16, triton.next_power_of_2(hidden)))
    return dict(H=H, D=D, BT=BT, BD=BD, BF=BF,
                G=CHECKPOINT_EVERY, IS_VARLEN=cu_seqlens is not None,
                HALF=half, PREC=dot_precision(q.dtype, BD),
                HAS_ETA_KEY=eta_key is not None, OUTPUT=output, **options)


def _slots(q: Tensor, N: int, count: int, hidden: int) -> list[Tensor]:
    """``count`` states per chain, fp32, as ``[N * H * count, ...]`` tensors."""
    H, D = q.shape[2], q.shape[3]
    rows = N * H * count
    return [q.new_empty(shape, dtype=torch.float32)
            for shape in ((rows, D, hidden), (rows, hidden), (rows, hidden, D), (rows, D))]


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, w: Tensor, b: Tensor, eta: Tensor,
                  eta_key: Tensor | None, state: list[Tensor], cu_seqlens: Tensor | None,
                  scale: float, eps: float, chunk_size: int, hidden: int, N: int, NG: int,
                  output: str, step: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """``(o, W1, b1, W2, b2, slots)``: ``state`` the four fp32 initial tensors, or empty
    (zeros); ``NG`` checkpoint slots per chain (0: none, a forward without backward);
    ``step``: a generation step of at most :data:`STEP_ROWS` rows per sequence (no slots)."""
    final = [torch.empty(shape, dtype=torch.float32, device=q.device)
             for shape in _state_shapes(q, N, hidden)]
    o = torch.empty_like(q)
    if step and _step(q, k, v, eta, w, b, eta_key, o, state, final, cu_seqlens, scale, eps,
                      hidden, N, output):
        return o, *final, []
    slots = _slots(q, N, NG, hidden) if NG else [None] * 4
    consts = _constants(q, chunk_size, hidden, cu_seqlens, eta_key, output)
    run_launch(Launch(ttt_mlp_fwd_chain_kernel, (N * q.shape[2],), (
        q, k, v, eta, w, b, eta_key, o, *(state or final), *final, *slots, cu_seqlens, scale,
        eps, q.shape[1], hidden, max(NG, 1)), dict(
        consts, USE_INITIAL=bool(state), SAVE=NG > 0)))
    return o, *final, (slots if NG else [])


_forward = torch.library.custom_op("ttt_triton::ttt_mlp_fwd", _forward_impl, mutates_args=())


@_forward.register_fake
def _forward_fake(q, k, v, w, b, eta, eta_key, state, cu_seqlens, scale, eps, chunk_size,
                  hidden, N, NG, output, step=False):
    final = [q.new_empty(shape, dtype=torch.float32) for shape in _state_shapes(q, N, hidden)]
    return torch.empty_like(q), *final, (_slots(q, N, NG, hidden) if NG else [])


@torch.library.custom_op("ttt_triton::ttt_mlp_bwd", mutates_args=())
def _backward(do: Tensor, dfinal: list[Tensor], q: Tensor, k: Tensor, v: Tensor, w: Tensor,
              b: Tensor, eta: Tensor, eta_key: Tensor | None, slots: list[Tensor],
              cu_seqlens: Tensor | None, scale: float, eps: float, chunk_size: int,
              hidden: int, N: int, NG: int, output: str) -> list[Tensor]:
    """``[dq, dk, dv, dw, db, deta, dW1, db1, dW2, db2]`` (plus ``deta_key`` with it), each
    in its input's dtype (the state's float32); ``dfinal`` the final state's cotangents."""
    H = q.shape[2]
    carry = [d.to(torch.float32).clone() for d in dfinal] if dfinal else [
        torch.zeros(shape, dtype=torch.float32, device=q.device)
        for shape in _state_shapes(q, N, hidden)]
    rows = [torch.empty(q.shape, dtype=torch.float32, device=q.device) for _ in range(3)]
    deta = torch.empty(eta.shape, dtype=torch.float32, device=q.device)
    deta_key = None if eta_key is None else torch.empty_like(deta)
    partials = [q.new_empty((N * H, q.shape[3]), dtype=torch.float32) for _ in range(2)]
    consts = _constants(q, chunk_size, hidden, cu_seqlens, eta_key, output, backward=True)
    tmp = q.new_empty((N * H, 4, consts["BT"], hidden), dtype=torch.float32)
    run_launch(Launch(ttt_mlp_bwd_chain_kernel, (N * H,), (
        q, k, v, eta, w, b, eta_key, do, *slots, *_slots(q, N, CHECKPOINT_EVERY, hidden),
        *carry, tmp, *rows, deta, deta_key, *partials, cu_seqlens, scale, eps, q.shape[1],
        hidden, NG), consts))
    dw, db = (p.view(N, H, -1).sum(0).to(t.dtype) for p, t in zip(partials, (w, b)))
    grads = [*(r.to(q.dtype) for r in rows), dw, db, deta.to(eta.dtype), *carry]
    return grads + ([] if deta_key is None else [deta_key.to(eta_key.dtype)])


@_backward.register_fake
def _backward_fake(do, dfinal, q, k, v, w, b, eta, eta_key, slots, cu_seqlens, scale, eps,
                   chunk_size, hidden, N, NG, output):
    grads = [torch.empty_like(q) for _ in range(3)] + [torch.empty_like(w),
                                                        torch.empty_like(b),
                                                        torch.empty_like(eta)]
    grads += [q.new_empty(shape, dtype=torch.float32) for shape in _state_shapes(q, N, hidden)]
    return grads + ([] if eta_key is None else [torch.empty_like(eta_key)])


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, w, b, eta, eta_key, state, cu_seqlens = inputs[:9]
    ctx.options = inputs[9:-1]          # scale, eps, chunk_size, hidden, N, NG, output
    ctx.has_state = bool(state)
    ctx.has_key = eta_key is not None
    ctx.has_cu = cu_seqlens is not None
    extra = [t for t in (eta_key, cu_seqlens) if t is not None]
    ctx.save_for_backward(q, k, v, w, b, eta, *extra, *output[5])


def _backward_of_forward(ctx, do, dW1, db1, dW2, db2, dslots):
    q, k, v, w, b, eta, *rest = ctx.saved_tensors
    eta_key = rest.pop(0) if ctx.has_key else None
    cu_seqlens = rest.pop(0) if ctx.has_cu else None
    hidden, N = ctx.options[3], ctx.options[4]
    dfinal = [torch.zeros(shape, dtype=torch.float32, device=q.device) if d is None else d
              for d, shape in zip((dW1, db1, dW2, db2), _state_shapes(q, N, hidden))]
    do = torch.zeros_like(q) if do is None else do.contiguous()
    grads = _backward(do, dfinal, q, k, v, w, b, eta, eta_key, rest, cu_seqlens,
                      *ctx.options)
    dq, dk, dv, dw, db, deta, *dstate = grads
    d_key = dstate.pop() if ctx.has_key else None
    return (dq, dk, dv, dw, db, deta, d_key, dstate if ctx.has_state else [],
            *[None] * len(ctx.needs_input_grad[8:]))


_forward.register_autograd(_backward_of_forward, setup_context=_setup_context)


def run_launch(launch: Launch) -> None:
    """Launches ``launch`` (tests/sm90_compile.py records it instead)."""
    launch()


def ttt_mlp_fwd(problem: MlpProblem) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``(o, (W1, b1, W2, b2))`` of ``problem``: the outputs and the final state (fp32),
    differentiable when ``problem.requires_grad``."""
    p = problem
    state = [] if p.mlp_state is None else list(p.mlp_state)    # (float32: validated)
    NG = 0
    if p.requires_grad:
        chunks = max(p.chunk_counts())
        NG = max(1, -(-chunks // CHECKPOINT_EVERY))
    step = schedule.row_step(p, p.requires_grad, STEP_ROWS)
    args = (p.q, p.k, p.v, p.w, p.b, p.eta, p.eta_key, state, p.cu_seqlens, float(p.scale),
            float(p.eps), p.chunk_size, p.hidden, p.N, NG, p.output, step)
    # without autograd, an eager call runs the op's implementation itself: the dispatcher's
    # generic glue would be most of a generation step's host time
    plain = not p.requires_grad and eager_and_plain((*args[:7], *state), p.q)
    o, *final, _ = (_forward_impl if plain else _forward)(*args)
    return o, tuple(final)
