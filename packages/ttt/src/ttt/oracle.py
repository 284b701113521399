"""The float64 oracle: TTT-linear written from its definition (docs/math.md), independent of
every backend.

It does not use the closed-form LayerNorm gradient the backends use: per chunk it states
each token's inner loss ``l_j * 1/2 ||LN(k_j W + hb) * w + b - (v_j - k_j)||^2`` on its own
copy of the state and lets autograd differentiate it; token ``i`` reads the state after the
step over tokens ``j <= i`` with its own learning rate, and the state moves by the chunk's
last (valid) token's step. Each sequence is cut into chunks on its own; an empty sequence's
final states are its initial states. Its own gradients come from autograd through
``create_graph=True`` inner gradients. Everything runs in float64 on the inputs' device; it
is slow and meant for tests.
"""

from __future__ import annotations

import math

import torch


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def _per_token_matmul(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """x [H, L, D] times each token's own W [H, L, D, E]: [H, L, E]."""
    return torch.einsum("hld,hlde->hle", x, W)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (the official TTT-MLP's), written out."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _linear(x, state):
    """TTT-Linear's inner model: x W + hb."""
    W, hb = state
    return _per_token_matmul(x, W) + hb


def _mlp(x, state):
    """TTT-MLP's inner model: gelu_tanh(x W1 + b1) W2 + b2."""
    W1, b1, W2, b2 = state
    return _per_token_matmul(gelu_tanh(_per_token_matmul(x, W1) + b1), W2) + b2


def _chunk(model, state, q, k, v, eta, eta_key, w, b, eps):
    """One chunk for one sequence, all heads, of the inner ``model`` (``_linear``,
    ``_mlp``) with parameters ``state`` (each [H, ...]); q, k, v [H, L, D]; eta, eta_key
    [H, L]; w, b [H, D]. Returns o [H, L, D] and the next state."""
    H, L, D = k.shape
    # One copy of the state per token, so that autograd gives per-token gradients.
    outer = torch.is_grad_enabled()
    per_token = [s.unsqueeze(1).expand(H, L, *s.shape[1:]) for s in state]
    per_token = [t if outer and t.requires_grad else t.detach().requires_grad_(True)
                 for t in per_token]          # no outer gradient: still the inner ones
    with torch.enable_grad():  # the inner gradients are part of the forward definition
        target = v - k
        token_loss = 0.5 * ((_layer_norm(model(k, per_token), eps) * w[:, None]
                             + b[:, None] - target) ** 2).sum(-1)      # [H, L]
        grads = torch.autograd.grad((eta_key * token_loss).sum(), per_token,
                                    create_graph=outer)
    # grad[h, j] = d l_j / d state; cumulative sums over tokens j <= i, times eta_i
    updated = [s.unsqueeze(1) - eta.reshape(H, L, *(1,) * (s.dim() - 1)) * g.cumsum(dim=1)
               for s, g in zip(state, grads)]
    return model(q, updated), [u[:, -1] for u in updated]


def _output(output, o, q, w, b, eps):
    if output == "raw":
        return o
    residual = q if output == "query_residual" else o
    return residual + _layer_norm(o, eps) * w + b


def _sequence(model, q, k, v, eta, eta_key, w, b, state, scale, eps, chunk_size, output):
    """q, k, v [T, H, D]; eta, eta_key [T, H]. Returns the output [T, H, D] and the final
    state."""
    T = q.shape[0]
    outputs = []
    for start in range(0, T, chunk_size):
        stop = min(start + chunk_size, T)
        part = [x[start:stop].transpose(0, 1) for x in (q, k, v, eta, eta_key)]
        o, state = _chunk(model, state, part[0] * scale, *part[1:], w, b, eps)
        outputs.append(o.transpose(0, 1))
    o = torch.cat(outputs, dim=0) if outputs else q.new_zeros(q.shape)   # (T == 0: empty)
    return _output(output, o, q, w, b, eps), state


def _run(model, q, k, v, w, b, eta, scale, eps, chunk_size, states, cu_seqlens, eta_key,
         output):
    """Every sequence of the batch through ``model`` from its initial ``states``, (weight
    [N, H, D_in, D_out], bias [N, H, 1, D_out]) pairs: (o, [final of each state tensor])."""
    B, T, H, D = q.shape
    if scale is None:
        scale = D ** -0.5
    if not isinstance(eta, torch.Tensor):
        eta = torch.full((B, T, H, 1), float(eta), dtype=q.dtype, device=q.device)
    eta = eta[..., 0]
    eta_key = torch.ones_like(eta) if eta_key is None else eta_key[..., 0]
    if cu_seqlens is None:
        spans = [(n, 0, T) for n in range(B)]
    else:
        offsets = [int(x) for x in cu_seqlens.tolist()]
        spans = [(0, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1)]
    if not spans:                   # an empty batch (B == 0)
        return q.new_zeros(q.shape), [s.clone() for s in states]
    is_bias = [i % 2 == 1 for i in range(len(states))]
    outputs, finals = [], []
    for n, (row, start, stop) in enumerate(spans):
        initial = [s[n, :, 0] if bias else s[n] for s, bias in zip(states, is_bias)]
        o, final = _sequence(model, q[row, start:stop], k[row, start:stop], v[row, start:stop],
                             eta[row, start:stop], eta_key[row, start:stop], w, b, initial,
                             scale, eps, chunk_size, output)
        outputs.append(o)
        finals.append([f.unsqueeze(1) if bias else f for f, bias in zip(final, is_bias)])
    o = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs).unsqueeze(0)
    return o, [torch.stack(parts) for parts in zip(*finals)]


def oracle_chunk_ttt_linear(q, k, v, w, b, eta, scale=None, eps=1e-6, chunk_size=16,
                            initial_state=None, initial_state_bias=None,
                            cu_seqlens=None, *, eta_key=None, output="norm_residual"):
    """float64 (o, final_state, final_state_bias) for float64 inputs (differentiable).

    Shapes as in :func:`ttt.chunk_ttt_linear`; ``eta`` a [B, T, H, 1] tensor or a float,
    ``eta_key`` a [B, T, H, 1] tensor or None. Final states are always returned.
    """
    B, T, H, D = q.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state is None:
        initial_state = q.new_zeros(N, H, D, D)
    if initial_state_bias is None:
        initial_state_bias = q.new_zeros(N, H, 1, D)
    o, (W, hb) = _run(_linear, q, k, v, w, b, eta, scale, eps, chunk_size,
                      [initial_state, initial_state_bias], cu_seqlens, eta_key, output)
    return o, W, hb


def oracle_chunk_ttt_mlp(q, k, v, w, b, eta, initial_state, scale=None, eps=1e-6,
                         chunk_size=16, cu_seqlens=None, *, eta_key=None,
                         output="norm_residual"):
    """TTT-MLP's float64 (o, (W1, b1, W2, b2) final) for float64 inputs (differentiable):
    the chunk step above with the inner model ``gelu_tanh(x W1 + b1) W2 + b2``.

    ``initial_state``: (W1 [N, H, D, F], b1 [N, H, 1, F], W2 [N, H, F, D], b2 [N, H, 1, D])
    for any hidden width F (the official layer's is 4 D); the rest as for
    :func:`oracle_chunk_ttt_linear`."""
    o, finals = _run(_mlp, q, k, v, w, b, eta, scale, eps, chunk_size, list(initial_state),
                     cu_seqlens, eta_key, output)
    return o, tuple(finals)
