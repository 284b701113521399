"""The public operator: validation, the backend's choice and autocast in Python, then the
custom op ``ttt::chunk_ttt_linear_fwd`` (``ttt._custom_op``) every backend goes through."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _custom_op, _empty
from .choice import select_backend
from .problem import Problem
from .validation import make_problem


def _autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False where it raises: meta)."""
    if device_type in ("cpu", "cuda"):
        return torch.is_autocast_enabled(device_type)
    try:
        return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(
            device_type)
    except RuntimeError:
        return False


def _in_autocast_region(q) -> bool:
    return isinstance(q, torch.Tensor) and _autocast_enabled(_custom_op.device_type(q))


def _autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v in the autocast dtype, as a matmul takes them (not float64); as given where k
    or v is no tensor (``make_problem`` says what is wrong)."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return q, k, v
    dtype = torch.get_autocast_dtype(_custom_op.device_type(q))

    def cast(t: torch.Tensor) -> torch.Tensor:
        eligible = t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible and t.dtype != dtype else t

    return cast(q), cast(k), cast(v)


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

    Args:
        q, k, v: ``[B, T, H, D]``, one dtype (float32, bfloat16, float16; float64 on
            backends that support it). Key dim equals value dim.
        w, b: ``[H, D]`` LayerNorm weight and bias, used by the inner loss and by the post
            norm-residual.
        eta: per-token inner learning rate ``[B, T, H, 1]``, or a float for a constant.
        scale: query scale, default ``D ** -0.5``; must be positive.
        eps: LayerNorm epsilon (inner loss and post norm).
        chunk_size: tokens per inner mini-batch (backends declare which sizes they take).
        initial_state, initial_state_bias: ``[N, H, D, D]`` and ``[N, H, 1, D]`` float32.
        output_final_state: also return the states after the last token.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (``B == 1``).
        eta_key: per-key factor ``[B, T, H, 1]`` of the inner learning rate, or None: token
            j's inner gradient enters the outputs and the state update scaled by
            ``eta_key[j]`` (the rank-1 learning rate ``eta[i] * eta_key[j]`` of the official
            TTT-Linear layer).
        output: ``"norm_residual"`` (``z + LN(z) * w + b``), ``"query_residual"``
            (``q + LN(z) * w + b``, q as given) or ``"raw"`` (``z``), z being the inner
            model's prediction for the scaled query.
        backend: a backend name for this call, overriding ``set_backend``/``TTT_BACKEND``.

    Returns:
        ``(o, final_state, final_state_bias)``: ``o`` ``[B, T, H, D]`` in q's dtype; the
        states float32 (float64 for float64 inputs), or None unless requested.

    Positions past a sequence's end take no part in any update; inputs are never modified.
    An empty sequence (``T == 0``, or equal offsets) computes nothing on every backend: empty
    outputs, final states = initial states (or zeros), zero gradients but the initial
    states' (the final states' cotangents). docs/math.md defines the operator.

    Under autocast, q, k and v are cast to its dtype (as a matmul takes them), nothing else.
    The work is one custom op, ``torch.ops.ttt.chunk_ttt_linear_fwd`` (backward
    ``ttt::chunk_ttt_linear_bwd``): ``torch.compile(fullgraph=True)`` traces a dense call
    without a graph break (a tensor ``cu_seqlens`` is read on the host: a break); the
    backend is chosen when the call is traced and kept by the compiled graph.
    """
    autocast = _in_autocast_region(q)
    if autocast:
        q, k, v = _autocast(q, k, v)
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
