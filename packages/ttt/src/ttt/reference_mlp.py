r"""TTT-MLP in plain PyTorch: the chunked dual form of docs/math.md ("TTT-MLP"), any device,
differentiable by autograd; half inputs compute in float32. Per chunk, every gradient at
the state the chunk starts from, with ``Z1 = k W1 + b1``, ``X2 = gelu(Z1)``, ``g2`` the
LayerNorm-L2 closed form at ``X2 W2 + b2`` (times ``eta_key``) and
``g1 = (g2 W2^T) * gelu'(Z1)``:

.. math::

    \bar Z_1 &= q W_1 + b_1 - \eta \odot \big((\mathrm{tril}(q k^\top) + \mathrm{tril}(1))\,
               g_1\big), \quad \bar X_2 = \mathrm{gelu}(\bar Z_1)\\
    z &= \bar X_2 W_2 + b_2 - \eta \odot \big((\mathrm{tril}(\bar X_2 X_2^\top)
         + \mathrm{tril}(1))\, g_2\big)

The reference backend's ``ttt_mlp`` op (:func:`mlp_forward`); the float64 definition it is
checked against is :func:`ttt.oracle.oracle_chunk_ttt_mlp`.
"""

from __future__ import annotations

import math

import torch

from .inner_loss import chunked, layer_norm_l2_grad
from .problem import MlpProblem, mlp_initial_states, state_dtype

_GELU_C = math.sqrt(2 / math.pi)


def _gelu_and_slope(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu_tanh(x) and its derivative."""
    t = torch.tanh(_GELU_C * (x + 0.044715 * x ** 3))
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * x * x)
    return 0.5 * x * (1 + t), slope


def _chunk(state, q, k, v, eta, key, w, b, eps):
    """One chunk of every (sequence, head): q, k, v [N, H, L, D]; eta, key [N, H, L, 1];
    w, b [1, H, 1, D]; state (W1, b1, W2, b2), biases [N, H, 1, F or D]. Returns z and the
    next state."""
    W1, b1, W2, b2 = state
    L = q.shape[2]
    causal = torch.ones(L, L, dtype=q.dtype, device=q.device).tril()           # [L, L]
    z1 = k @ W1 + b1                                                            # [N, H, L, F]
    x2, slope = _gelu_and_slope(z1)
    g2 = layer_norm_l2_grad(x2 @ W2 + b2, k, v, w, b, eps)                     # [N, H, L, D]
    if key is not None:
        g2 = g2 * key
    g1 = (g2 @ W2.transpose(-1, -2)) * slope                                    # [N, H, L, F]
    z1_bar = q @ W1 + b1 - eta * (((q @ k.transpose(-1, -2)) * causal + causal) @ g1)
    x2_bar, _ = _gelu_and_slope(z1_bar)
    z = x2_bar @ W2 + b2 - eta * (((x2_bar @ x2.transpose(-1, -2)) * causal + causal) @ g2)
    last = eta[:, :, -1:]                                                       # [N, H, 1, 1]
    return z, (W1 - last * (k.transpose(-1, -2) @ g1), b1 - last * g1.sum(-2, keepdim=True),
               W2 - last * (x2.transpose(-1, -2) @ g2), b2 - last * g2.sum(-2, keepdim=True))


def chunk_ttt_mlp(q, k, v, w, b, eta, initial_state, scale=None, eps=1e-6, chunk_size=16,
                  cu_seqlens=None, *, eta_key=None, output="norm_residual"):
    """TTT-MLP over a batch: ``(o, (W1, b1, W2, b2))``, ``o`` in q's dtype, the final state in
    float32 (float64 for float64 inputs). Shapes as :func:`ttt.oracle.oracle_chunk_ttt_mlp`'s:
    q, k, v [B, T, H, D]; w, b [H, D]; eta (a float or [B, T, H, 1]) and eta_key
    [B, T, H, 1]; ``initial_state`` (W1 [N, H, D, F], b1 [N, H, 1, F], W2 [N, H, F, D],
    b2 [N, H, 1, D]); cu_seqlens [N + 1] for a packed batch (B = 1)."""
    B, T, H, D = q.shape
    if not isinstance(eta, torch.Tensor):
        eta = torch.full((B, T, H, 1), float(eta), dtype=state_dtype(q.dtype), device=q.device)
    seq_lens = None
    if cu_seqlens is not None:
        offsets = [int(x) for x in cu_seqlens.tolist()]
        seq_lens = [stop - start for start, stop in zip(offsets[:-1], offsets[1:])]
    return chunked(_chunk, q, k, v, w, b, eta, eta_key, initial_state,
                   D ** -0.5 if scale is None else scale, eps, chunk_size, seq_lens, output)


def mlp_forward(problem: MlpProblem):
    """:func:`chunk_ttt_mlp` of a validated problem: ``(o, final state)``."""
    p = problem
    return chunk_ttt_mlp(p.q, p.k, p.v, p.w, p.b, p.eta, mlp_initial_states(p), p.scale, p.eps,
                         p.chunk_size, p.cu_seqlens, eta_key=p.eta_key, output=p.output)
