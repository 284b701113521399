"""The TTT-MLP forward launcher: one launch of :mod:`.fwd_chain`'s kernel (one program per
(sequence, head)), behind the custom op ``ttt_triton::ttt_mlp_fwd`` so that
``torch.compile`` and CUDA graphs see one opaque call."""

from __future__ import annotations

import torch

from ttt.problem import MlpProblem

from ..._env import kernels_interpreted
from ..ttt_linear.launches import Launch
from ..ttt_linear.tuning import dot_precision
from .fwd_chain import ttt_mlp_fwd_chain_kernel

NUM_WARPS = 8
"""Warps per program. The chunk's tiles (q, k, g2, z [BT, BD] and two [BT, BT]) stay live over
the hidden walks; at 4 warps the sm_90 build of bf16, head dim 64, chunk 16 needs every
register and spills (tools.resources' counts), at 8 it does not (hidden block 32)."""


def hidden_block(BD: int) -> int:
    """Hidden columns (of W1; rows of W2) per block of the state the kernel streams: 32 at a
    padded head dim up to 64, 16 above (the [BD, BF] and [BF, BD] blocks in registers)."""
    return 32 if BD <= 64 else 16


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _state_shapes(q: torch.Tensor, N: int, F: int) -> tuple[tuple[int, ...], ...]:
    H, D = q.shape[2], q.shape[3]
    return (N, H, D, F), (N, H, 1, F), (N, H, F, D), (N, H, 1, D)


@torch.library.custom_op("ttt_triton::ttt_mlp_fwd", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
             b: torch.Tensor, eta: torch.Tensor, eta_key: torch.Tensor | None,
             state: list[torch.Tensor], cu_seqlens: torch.Tensor | None, scale: float,
             eps: float, chunk_size: int, hidden: int, N: int,
             output: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor]:
    """``(o, W1, b1, W2, b2)``; ``state`` the four fp32 initial tensors, or empty (zeros)."""
    H, D = q.shape[2], q.shape[3]
    final = [torch.empty(shape, dtype=torch.float32, device=q.device)
             for shape in _state_shapes(q, N, hidden)]
    o = torch.empty_like(q)
    BD = _pow2(D)
    options = {} if kernels_interpreted() else {"num_warps": NUM_WARPS}
    run_launch(Launch(ttt_mlp_fwd_chain_kernel, (N * H,), (
        q, k, v, eta, w, b, eta_key, o, *(state or final), *final, None, None, None, None,
        cu_seqlens, scale, eps, q.shape[1], hidden, 1), dict(
        H=H, D=D, BT=chunk_size, BD=BD, BF=min(hidden_block(BD), _pow2(hidden)), G=1,
        USE_INITIAL=bool(state), IS_VARLEN=cu_seqlens is not None, SAVE=False,
        HALF=q.dtype != torch.float32, PREC=dot_precision(q.dtype, BD),
        HAS_ETA_KEY=eta_key is not None, OUTPUT=output, **options)))
    return (o, *final)


def run_launch(launch: Launch) -> None:
    """Launches ``launch`` (tests/sm90_compile.py records it instead)."""
    launch()


@_forward.register_fake
def _forward_fake(q, k, v, w, b, eta, eta_key, state, cu_seqlens, scale, eps, chunk_size,
                  hidden, N, output):
    return (torch.empty_like(q), *(q.new_empty(shape, dtype=torch.float32)
                                   for shape in _state_shapes(q, N, hidden)))


def ttt_mlp_fwd(problem: MlpProblem) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(o, (W1, b1, W2, b2))`` of ``problem``: the outputs and the final state (fp32)."""
    p = problem
    state = [] if p.mlp_state is None else [s.to(torch.float32) for s in p.mlp_state]
    o, *final = _forward(p.q, p.k, p.v, p.w, p.b, p.eta, p.eta_key, state, p.cu_seqlens,
                         float(p.scale), float(p.eps), p.chunk_size, p.hidden, p.N, p.output)
    return o, tuple(final)
