"""The public operator: validation, the backend's choice and autocast in Python, then the
custom op ``ttt::chunk_ttt_linear_fwd`` (``ttt._custom_op``) every backend goes through."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _custom_op, _empty
from .choice import select_backend
from .problem import Problem
from .validation import make_problem


def autocast_inputs(q, k, v) -> tuple[bool, Tensor, Tensor, Tensor]:
    """Whether an autocast region is on for q's device type, and q, k, v in its dtype, as a
    matmul takes them (not float64); as given where one is no tensor (``make_problem`` says
    what is wrong)."""
    autocast = _custom_op.autocast_on(q)
    if not (autocast and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return autocast, q, k, v
    dtype = torch.get_autocast_dtype(_custom_op.device_type(q))

    def cast(t: Tensor) -> Tensor:
        eligible = t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible and t.dtype != dtype else t

    return True, cast(q), cast(k), cast(v)


def _backend_name(problem: Problem, requested: str | None) -> str:
    """The chosen backend's name; while compiling, once per trace (dynamo does not trace the
    choice, which lives in a ContextVar)."""
    if not torch.compiler.is_compiling():
        return select_backend(problem, requested).name
    from ._compiled_choice import compiled_backend_name  # (imports torch._dynamo)

    return compiled_backend_name(problem.signature(), requested)


def chunk_ttt_linear(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, b: Tensor, eta: Tensor | float,
    scale: float | None = None, eps: float = 1e-6, chunk_size: int = 16,
    initial_state: Tensor | None = None, initial_state_bias: Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: Tensor | None = None, *,
    eta_key: Tensor | None = None, output: str = "norm_residual", backend: str | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    r"""Chunked TTT-linear: a linear inner model trained by one gradient step per chunk.

    ``q, k, v [B, T, H, D]``, ``w, b [H, D]`` (the LayerNorm weight and bias), ``eta``
    ``[B, T, H, 1]`` or a float, the states ``[N, H, D, D]`` and ``[N, H, 1, D]``,
    ``cu_seqlens [N + 1]`` offsets of packed sequences (``B == 1``), ``eta_key`` the
    per-key factor of the inner learning rate, ``output`` the output form, ``backend`` a
    name for this call. Returns ``(o, final_state, final_state_bias)``, the states None
    unless ``output_final_state``. Every argument, dtype, empty sequences, autocast and
    torch.compile: docs/api.md; the operator: docs/math.md.
    """
    autocast, q, k, v = autocast_inputs(q, k, v)
    problem = make_problem(q, k, v, w, b, eta, scale=scale, eps=eps, chunk_size=chunk_size,
                           initial_state=initial_state, initial_state_bias=initial_state_bias,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           eta_key=eta_key, output=output)
    if _empty.has_no_tokens(problem):                 # nothing to compute, on any backend
        _backend_name(problem, backend)               # (the choice's errors all the same)
        o, ht, hbt = _empty.no_tokens(problem)
        return (o, ht, hbt) if problem.output_final_state else (o, None, None)
    full = index = None
    if _empty.has_empty_sequences(problem):           # the backend gets the others only
        full, (problem, index) = problem, _empty.without_empty_sequences(problem)
    o, finals, _ = _custom_op.forward(problem, _backend_name(problem, backend), autocast)
    if not problem.output_final_state:
        return o, None, None
    if full is not None:
        return (o, *_empty.scatter_final_states(full, index, finals[0], finals[1]))
    return o, finals[0], finals[1]
