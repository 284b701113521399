"""The public operator and the one autograd.Function every backend goes through."""

from __future__ import annotations

import torch

from .backend import Backend, GradNeeds
from .problem import Problem
from .registry import select_backend
from .validation import make_problem


def _cast_like(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None or like is None:
        return None
    return grad if grad.dtype == like.dtype else grad.to(like.dtype)


class ChunkTTTLinearFunction(torch.autograd.Function):
    """Forward and backward through a backend; gradients cast to each input's dtype."""

    @staticmethod
    def forward(ctx, backend: Backend, problem: Problem, q, k, v, w, b, eta, h0, hb0, eta_key):
        ctx.set_materialize_grads(False)
        o, ht, hbt, saved = backend.forward(problem, needs_backward=problem.requires_grad)
        ctx.backend, ctx.problem = backend, problem
        ctx.saved = saved if problem.requires_grad else None
        return o, ht, hbt

    @staticmethod
    def backward(ctx, do, dht, dhbt):
        problem: Problem = ctx.problem
        need = ctx.needs_input_grad
        needs = GradNeeds(q=need[2], k=need[3], v=need[4], w=need[5], b=need[6],
                          eta=need[7] and problem.eta_is_tensor, initial_state=need[8],
                          initial_state_bias=need[9], eta_key=need[10])
        if do is None:
            do = torch.zeros_like(problem.q)
        grads = ctx.backend.backward(problem, ctx.saved, do.contiguous(),
                                     None if dht is None else dht.contiguous(),
                                     None if dhbt is None else dhbt.contiguous(), needs)
        ctx.saved = None
        p = problem
        return (None, None,
                _cast_like(grads.dq, p.q) if needs.q else None,
                _cast_like(grads.dk, p.k) if needs.k else None,
                _cast_like(grads.dv, p.v) if needs.v else None,
                _cast_like(grads.dw, p.w) if needs.w else None,
                _cast_like(grads.db, p.b) if needs.b else None,
                _cast_like(grads.deta, p.eta) if needs.eta else None,
                _cast_like(grads.dh0, p.initial_state) if needs.initial_state else None,
                _cast_like(grads.dhb0, p.initial_state_bias) if needs.initial_state_bias else None,
                _cast_like(grads.deta_key, p.eta_key) if needs.eta_key else None)


def chunk_ttt_linear(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    eta: torch.Tensor | float,
    scale: float | None = None,
    eps: float = 1e-6,
    chunk_size: int = 16,
    initial_state: torch.Tensor | None = None,
    initial_state_bias: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    eta_key: torch.Tensor | None = None,
    output: str = "norm_residual",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
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

    Positions past a sequence's end (in its last, partial chunk) take no part in any
    update. Inputs are never modified. See docs/math.md for the exact definition.
    """
    problem = make_problem(q, k, v, w, b, eta, scale=scale, eps=eps, chunk_size=chunk_size,
                           initial_state=initial_state, initial_state_bias=initial_state_bias,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           eta_key=eta_key, output=output)
    chosen = select_backend(problem, backend)
    o, ht, hbt = ChunkTTTLinearFunction.apply(
        chosen, problem, problem.q, problem.k, problem.v, problem.w, problem.b, problem.eta,
        problem.initial_state, problem.initial_state_bias, problem.eta_key)
    return o, ht, hbt
