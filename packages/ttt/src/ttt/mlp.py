"""The public TTT-MLP operator ``ttt.chunk_ttt_mlp``: the arguments of ``chunk_ttt_linear``
with a two-layer MLP inner model, whose state ``(W1, b1, W2, b2)`` replaces TTT-Linear's
``(W, b)``. Validation, autocast and the backend's choice are the linear op's; the backend
computes it with its ``chunk_ttt_mlp`` (differentiable by autograd)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import _empty
from ._custom_op import no_autocast
from .ops import _backend_name, autocast_inputs
from .problem import MlpProblem, as_mlp_problem, mlp_initial_states
from .registry import load_backend
from .validation import check_states, make_problem, positive_int

STATE_NAMES = ("W1", "b1", "W2", "b2")
HIDDEN_FACTOR = 4
"""The hidden width of the inner MLP without an initial state, in head dims (the official
layer's); any width is taken with an initial state."""


def make_mlp_problem(q, k, v, w, b, eta, *, scale=None, eps=1e-6, chunk_size=16,
                     initial_state=None, output_final_state=False, cu_seqlens=None,
                     eta_key=None, output="norm_residual") -> MlpProblem:
    """Check every argument of :func:`chunk_ttt_mlp` and return its :class:`MlpProblem`."""
    problem = make_problem(q, k, v, w, b, eta, scale=scale, eps=eps, chunk_size=chunk_size,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           eta_key=eta_key, output=output)
    p, state, hidden = problem, initial_state, HIDDEN_FACTOR * problem.D
    if state is not None:
        if not (isinstance(state, (tuple, list)) and len(state) == 4):
            raise TypeError(f"initial_state: expected a tuple (W1, b1, W2, b2) of 4 tensors, "
                            f"got {type(state).__name__}"
                            + (f" of {len(state)}" if isinstance(state, (tuple, list)) else ""))
        W1 = state[0]
        hidden = W1.shape[-1] if isinstance(W1, Tensor) and W1.dim() == 4 else hidden
        check_states([f"initial_state.{name}" for name in STATE_NAMES], state, p.N, p.H, p.D,
                     hidden, p.dtype, p.device, p.is_varlen)
        positive_int("initial_state.W1 hidden width", hidden)
        state = tuple(t.contiguous() for t in state)
    requires_grad = problem.requires_grad or (torch.is_grad_enabled() and state is not None
                                              and any(t.requires_grad for t in state))
    return as_mlp_problem(problem, state, hidden, requires_grad)


def chunk_ttt_mlp(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, b: Tensor, eta: Tensor | float,
    scale: float | None = None, eps: float = 1e-6, chunk_size: int = 16,
    initial_state: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    output_final_state: bool = False, cu_seqlens: Tensor | None = None, *,
    eta_key: Tensor | None = None, output: str = "norm_residual", backend: str | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor] | None]:
    r"""Chunked TTT-MLP: a two-layer MLP inner model ``gelu_tanh(x W1 + b1) W2 + b2`` trained
    by one gradient step per chunk. The arguments of :func:`ttt.chunk_ttt_linear` but the
    state, ``initial_state = (W1 [N, H, D, F], b1 [N, H, 1, F], W2 [N, H, F, D],
    b2 [N, H, 1, D])`` or None (zeros, ``F = 4 D``). Returns ``(o, final_state)``, the
    state None unless ``output_final_state``. docs/api.md, docs/math.md ("TTT-MLP").
    """
    autocast, q, k, v = autocast_inputs(q, k, v)
    problem = make_mlp_problem(q, k, v, w, b, eta, scale=scale, eps=eps,
                               chunk_size=chunk_size, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                               eta_key=eta_key, output=output)
    chosen = load_backend(_backend_name(problem, backend))
    with no_autocast(problem.q, autocast):           # the backend computes as it chooses
        o, final = _run(chosen, problem)
    return o, (final if problem.output_final_state else None)


def _run(chosen, problem: MlpProblem) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``(o, final state)`` of ``problem`` on backend ``chosen``, which sees no empty
    sequence."""
    if _empty.has_no_tokens(problem):                 # nothing to compute
        final = tuple(s.clone() for s in mlp_initial_states(problem))   # (never an input)
        o = torch.empty_like(problem.q)
    elif _empty.has_empty_sequences(problem):         # the backend gets the others only
        part, index = _empty.without_empty_sequences(problem)
        state = tuple(s.index_select(0, index) for s in mlp_initial_states(problem))
        o, kept = chosen.chunk_ttt_mlp(dataclasses.replace(part, mlp_state=state,
                                                           output_final_state=True))
        final = tuple(s.index_copy(0, index, f)
                      for s, f in zip(mlp_initial_states(problem), kept))
    else:
        o, final = chosen.chunk_ttt_mlp(problem)
    return o, final
