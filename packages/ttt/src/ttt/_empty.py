"""Empty sequences, handled by the core so that no backend ever sees one (docs/api.md):
a call without tokens computes nothing, and a packed batch goes to the backend without its
empty sequences, whose final states (the initial ones) are scattered back in place."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from .problem import Problem, state_shapes


def has_no_tokens(problem: Problem) -> bool:
    """Whether ``T == 0`` or ``B == 0`` (a Problem has heads and a head dim)."""
    return problem.q.numel() == 0


def has_empty_sequences(problem: Problem) -> bool:
    return problem.is_varlen and 0 in problem.seq_lens


def _initial_states(h0, hb0, shapes: tuple[tuple, tuple], dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, ...]:
    """New tensors (never the inputs themselves) of the initial states, or zeros."""
    return tuple(torch.zeros(shape, dtype=dtype, device=device) if given is None
                 else given.to(dtype, copy=True) for given, shape in zip((h0, hb0), shapes))


class _NoTokens(torch.autograd.Function):
    """``(o, final_state, final_state_bias)`` of a call without tokens, differentiable."""

    @staticmethod
    def forward(ctx, shapes, state_dtype, q, k, v, w, b, eta, eta_key, h0, hb0):
        ctx.set_materialize_grads(False)
        ctx.likes = [None if t is None else (t.shape, t.dtype)
                     for t in (q, k, v, w, b, eta, eta_key, h0, hb0)]
        ctx.device = q.device
        return (torch.empty_like(q), *_initial_states(h0, hb0, shapes, state_dtype, q.device))

    @staticmethod
    def backward(ctx, do, dht, dhbt):
        grads = []
        for i, like in enumerate(ctx.likes):
            if like is None or not ctx.needs_input_grad[i + 2]:
                grads.append(None)
                continue
            shape, dtype = like
            cotangent = dht if i == 7 else dhbt if i == 8 else None
            grads.append(torch.zeros(shape, dtype=dtype, device=ctx.device)
                         if cotangent is None else cotangent.to(dtype))
        return (None, None, *grads)


def no_tokens(problem: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, final_state, final_state_bias)`` of a call without tokens."""
    p = problem
    shapes = state_shapes(p.N, p.H, p.D)
    if p.requires_grad:
        return _NoTokens.apply(shapes, p.state_dtype, p.q, p.k, p.v, p.w, p.b, p.eta,
                               p.eta_key, p.initial_state, p.initial_state_bias)
    return (torch.empty_like(p.q), *_initial_states(p.initial_state, p.initial_state_bias,
                                                    shapes, p.state_dtype, p.device))


def without_empty_sequences(problem: Problem) -> tuple[Problem, torch.Tensor]:
    """The problem of the non-empty sequences alone, and their indices (int64)."""
    p = problem
    kept = [n for n, length in enumerate(p.seq_lens) if length]
    lengths = tuple(p.seq_lens[n] for n in kept)
    offsets = [0, *itertools.accumulate(lengths)]
    index = torch.tensor(kept, dtype=torch.int64, device=p.device)
    h0, hb0 = (None if s is None else s.index_select(0, index)
               for s in (p.initial_state, p.initial_state_bias))
    cu_seqlens = torch.tensor(offsets, dtype=torch.int64, device=p.device)
    return dataclasses.replace(p, cu_seqlens=cu_seqlens, seq_lens=lengths, initial_state=h0,
                               initial_state_bias=hb0), index


def scatter_final_states(problem: Problem, index: torch.Tensor, ht: torch.Tensor,
                         hbt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's final states: ``ht, hbt`` at rows ``index``, else the initial ones."""
    p = problem
    base, base_bias = _initial_states(p.initial_state, p.initial_state_bias,
                                      state_shapes(p.N, p.H, p.D), p.state_dtype, p.device)
    return base.index_copy(0, index, ht), base_bias.index_copy(0, index, hbt)
