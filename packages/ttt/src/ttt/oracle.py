r"""The float64 oracle: TTT-linear written from its definition, independent of every backend.

Instead of the backends' closed-form LayerNorm gradient, it states each token's inner loss
per chunk and lets autograd differentiate it:

.. math::

    \ell_j(W, hb) = \tfrac12\, l_j \big\| \mathrm{LN}(k_j W + hb) \odot w + b - (v_j - k_j)
                    \big\|^2

with LN over the head dim (biased variance, ``eps``, no affine) and ``l_j`` token j's
``eta_key`` (1 when None). Token ``i`` reads the state after a step over tokens ``j <= i``
of its chunk with its own rate; the state then takes the chunk's last (valid) token's step:

.. math::

    W_i = W - \eta_i \sum_{j \le i} \nabla_W \ell_j, \quad
    hb_i = hb - \eta_i \sum_{j \le i} \nabla_{hb} \ell_j, \quad
    o_i = (\text{scale}\, q_i) W_i + hb_i

    W \leftarrow W_{last}, \quad hb \leftarrow hb_{last}

and the result is ``o + LN(o) * w + b`` (``"norm_residual"``), ``q + LN(o) * w + b`` with
the unscaled q (``"query_residual"``) or ``o`` (``"raw"``). Each sequence is chunked on its
own (packed ones restart at every offset); a partial last chunk holds only real tokens; an
empty sequence has no chunk (final states = initial states). Gradients come from autograd
through ``create_graph=True`` inner gradients. Float64, slow, meant for tests.
"""

from __future__ import annotations

import torch


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def _chunk(W, hb, q, k, v, eta, eta_key, w, b, eps):
    """One chunk for one sequence, all heads. W [H, D, D], hb [H, D]; q, k, v [H, L, D];
    eta, eta_key [H, L]; w, b [H, D]. Returns o [H, L, D] and the next (W, hb)."""
    H, L, D = k.shape
    # One copy of the state per token, so that autograd gives per-token gradients.
    outer = torch.is_grad_enabled()
    W_tok = W.unsqueeze(1).expand(H, L, D, D)
    hb_tok = hb.unsqueeze(1).expand(H, L, D)
    if not (outer and W_tok.requires_grad):  # no outer gradient into W: still need inner ones
        W_tok = W_tok.detach().requires_grad_(True)
        hb_tok = hb_tok.detach().requires_grad_(True)
    with torch.enable_grad():  # the inner gradients are part of the forward definition
        prediction = torch.einsum("hld,hlde->hle", k, W_tok) + hb_tok
        target = v - k
        token_loss = 0.5 * ((_layer_norm(prediction, eps) * w[:, None] + b[:, None] - target)
                            ** 2).sum(-1)                            # [H, L]
        loss = (eta_key * token_loss).sum()
        grad_W, grad_hb = torch.autograd.grad(loss, (W_tok, hb_tok),
                                              create_graph=outer)
    # grad_W[h, j] = d l_j / dW; cumulative sums over tokens j <= i
    W_i = W.unsqueeze(1) - eta[:, :, None, None] * grad_W.cumsum(dim=1)     # [H, L, D, D]
    hb_i = hb.unsqueeze(1) - eta[:, :, None] * grad_hb.cumsum(dim=1)         # [H, L, D]
    o = torch.einsum("hld,hlde->hle", q, W_i) + hb_i
    return o, W_i[:, -1], hb_i[:, -1]


def _output(output, o, q, w, b, eps):
    if output == "raw":
        return o
    residual = q if output == "query_residual" else o
    return residual + _layer_norm(o, eps) * w + b


def _sequence(q, k, v, eta, eta_key, w, b, W, hb, scale, eps, chunk_size, output):
    """q, k, v [T, H, D]; eta, eta_key [T, H]. Returns the output [T, H, D], final W, hb."""
    T = q.shape[0]
    outputs = []
    for start in range(0, T, chunk_size):
        stop = min(start + chunk_size, T)
        part = [x[start:stop].transpose(0, 1) for x in (q, k, v, eta, eta_key)]
        o, W, hb = _chunk(W, hb, part[0] * scale, *part[1:], w, b, eps)
        outputs.append(o.transpose(0, 1))
    o = torch.cat(outputs, dim=0) if outputs else q.new_zeros(q.shape)   # (T == 0: empty)
    return _output(output, o, q, w, b, eps), W, hb


def oracle_chunk_ttt_linear(q, k, v, w, b, eta, scale=None, eps=1e-6, chunk_size=16,
                            initial_state=None, initial_state_bias=None,
                            cu_seqlens=None, *, eta_key=None, output="norm_residual"):
    """float64 (o, final_state, final_state_bias) for float64 inputs (differentiable),
    arguments as :func:`ttt.chunk_ttt_linear`'s; final states are always returned."""
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    if not isinstance(eta, torch.Tensor):
        eta = torch.full((B, T, H, 1), float(eta), dtype=q.dtype, device=q.device)
    eta = eta[..., 0]
    eta_key = torch.ones_like(eta) if eta_key is None else eta_key[..., 0]
    if cu_seqlens is None:
        spans = [(n, 0, T) for n in range(B)]
    else:
        offsets = [int(x) for x in cu_seqlens.tolist()]
        spans = [(0, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1)]
    N = len(spans)
    if initial_state is None:
        initial_state = q.new_zeros(N, H, D, D)
    if initial_state_bias is None:
        initial_state_bias = q.new_zeros(N, H, 1, D)

    outputs, finals, final_biases = [], [], []
    for n, (row, start, stop) in enumerate(spans):
        o, W, hb = _sequence(q[row, start:stop], k[row, start:stop], v[row, start:stop],
                             eta[row, start:stop], eta_key[row, start:stop], w, b,
                             initial_state[n], initial_state_bias[n, :, 0], scale, eps,
                             chunk_size, output)
        outputs.append(o)
        finals.append(W)
        final_biases.append(hb.unsqueeze(1))
    if not spans:                   # an empty batch (B == 0)
        return q.new_zeros(q.shape), initial_state.clone(), initial_state_bias.clone()
    o = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs).unsqueeze(0)
    return o, torch.stack(finals), torch.stack(final_biases)
