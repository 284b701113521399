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
from .validation import (
    _STATE_DTYPES,
    _STATE_DTYPES_OF_FLOAT64,
    _broken_rule,
    _tensor_error,
    dtype_name,
    make_problem,
    positive_int,
)

STATE_NAMES = ("W1", "b1", "W2", "b2")
HIDDEN_FACTOR = 4
"""The hidden width of the inner MLP without an initial state, in head dims (the official
layer's); any width is taken with an initial state."""


def _checked_state(state, N: int, H: int, D: int, dtype: torch.dtype, device: torch.device,
                   what_n: str) -> int:
    """The hidden width F of ``state``, four tensors ``W1 [N, H, D, F]``, ``b1 [N, H, 1, F]``,
    ``W2 [N, H, F, D]``, ``b2 [N, H, 1, D]`` in a state dtype on q's device."""
    if not (isinstance(state, (tuple, list)) and len(state) == 4):
        raise TypeError(f"initial_state: expected a tuple (W1, b1, W2, b2) of 4 tensors, got "
                        f"{type(state).__name__}"
                        + (f" of {len(state)}" if isinstance(state, (tuple, list)) else ""))
    W1 = state[0]
    F = W1.shape[-1] if isinstance(W1, Tensor) and W1.dim() == 4 else HIDDEN_FACTOR * D
    dtypes = _STATE_DTYPES_OF_FLOAT64 if dtype == torch.float64 else _STATE_DTYPES
    for name, t, shape, meaning in zip(
            STATE_NAMES, state, ((N, H, D, F), (N, H, 1, F), (N, H, F, D), (N, H, 1, D)),
            ("[N, H, D, F]", "[N, H, 1, F]", "[N, H, F, D]", "[N, H, 1, D]")):
        rule = _broken_rule(t, dtypes, shape, device)
        if rule is not None:
            raise _tensor_error(f"initial_state.{name}", t, rule, shape,
                                f"{meaning}, N = {N} {what_n}", device,
                                str([dtype_name(d) for d in dtypes]))
    return positive_int("initial_state.W1 hidden width", F)


def make_mlp_problem(q, k, v, w, b, eta, *, scale=None, eps=1e-6, chunk_size=16,
                     initial_state=None, output_final_state=False, cu_seqlens=None,
                     eta_key=None, output="norm_residual") -> MlpProblem:
    """Check every argument of :func:`chunk_ttt_mlp` and return its :class:`MlpProblem`."""
    problem = make_problem(q, k, v, w, b, eta, scale=scale, eps=eps, chunk_size=chunk_size,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           eta_key=eta_key, output=output)
    hidden, state = HIDDEN_FACTOR * problem.D, None
    if initial_state is not None:
        hidden = _checked_state(initial_state, problem.N, problem.H, problem.D, problem.dtype,
                                problem.device, "sequences in cu_seqlens"
                                if cu_seqlens is not None else "batch")
        state = tuple(t.contiguous() for t in initial_state)
    requires_grad = problem.requires_grad or (torch.is_grad_enabled() and state is not None
                                              and any(t.requires_grad for t in state))
    return as_mlp_problem(problem, state, hidden, requires_grad)


def _without_empty_sequences(problem: MlpProblem) -> tuple[MlpProblem, Tensor]:
    """The problem of the non-empty sequences alone (``_empty``'s, with their MLP states),
    and their indices (int64)."""
    part, index = _empty.without_empty_sequences(problem)
    state = tuple(s.index_select(0, index) for s in mlp_initial_states(problem))
    return dataclasses.replace(part, mlp_state=state), index


def chunk_ttt_mlp(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, b: Tensor, eta: Tensor | float,
    scale: float | None = None, eps: float = 1e-6, chunk_size: int = 16,
    initial_state: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    output_final_state: bool = False, cu_seqlens: Tensor | None = None, *,
    eta_key: Tensor | None = None, output: str = "norm_residual", backend: str | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor] | None]:
    r"""Chunked TTT-MLP: a two-layer MLP inner model ``gelu_tanh(x W1 + b1) W2 + b2`` trained
    by one gradient step per chunk (docs/math.md, "TTT-MLP").

    Args as :func:`ttt.chunk_ttt_linear`'s, but the state:
        initial_state: ``(W1 [N, H, D, F], b1 [N, H, 1, F], W2 [N, H, F, D],
            b2 [N, H, 1, D])`` float32 (float64 for float64 inputs), any hidden width F; or
            None: zeros of width ``F = 4 D`` (the official layer's).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, D]`` in q's dtype; ``final_state`` the four
        tensors after each sequence's last token (float32, or float64 for float64 inputs),
        or None unless ``output_final_state``.

    Positions past a sequence's end and empty sequences take no part (an empty sequence's
    final state is its initial state); inputs are never modified. Under autocast, q, k and v
    are cast to its dtype. Differentiable with respect to every tensor argument.
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
    if problem.q.numel() == 0:                        # no tokens: nothing to compute
        final = tuple(s.clone() for s in mlp_initial_states(problem))   # (never an input)
        o = torch.empty_like(problem.q)
    elif problem.is_varlen and 0 in problem.seq_lens:  # the backend gets the others only
        part, index = _without_empty_sequences(problem)
        o, kept = chosen.chunk_ttt_mlp(dataclasses.replace(part, output_final_state=True))
        final = tuple(s.index_copy(0, index, f)
                      for s, f in zip(mlp_initial_states(problem), kept))
    else:
        o, final = chosen.chunk_ttt_mlp(problem)
    return o, final
