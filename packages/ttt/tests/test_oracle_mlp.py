"""The float64 TTT-MLP oracle (``ttt.oracle.oracle_chunk_ttt_mlp``: per-token parameter
copies, inner gradients by autograd) against the official layer's dual form, rebuilt here
from its math: closed-form LayerNorm-L2 and GELU-tanh backward, the ``tril`` attention
matrices, the ``b_bar`` and ``Z_bar`` updates and the last token's step. Outputs, final
states and every gradient (both differentiable in float64) agree to rounding. Then the
PyTorch implementation ``ttt.reference_mlp`` against the oracle."""

from __future__ import annotations

import math

import pytest
import torch

from ttt.oracle import oracle_chunk_ttt_mlp

F64 = torch.float64
C = math.sqrt(2 / math.pi)


def _gelu(x):
    return 0.5 * x * (1 + torch.tanh(C * (x + 0.044715 * x ** 3)))


def _gelu_bwd(x):
    t = torch.tanh(C * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * C * (1 + 3 * 0.044715 * x * x)


def _ln(z, eps):
    mu = z.mean(-1, keepdim=True)
    return (z - mu) / torch.sqrt(((z - mu) ** 2).mean(-1, keepdim=True) + eps)


def _ln_l2_bwd(z, target, w, b, eps):
    """d/dz of 1/2 ||LN(z) w + b - target||^2, row by row (the official closed form)."""
    mu = z.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt(((z - mu) ** 2).mean(-1, keepdim=True) + eps)
    x_hat = (z - mu) * rstd
    y = (x_hat * w + b - target) * w
    return rstd * (y - y.mean(-1, keepdim=True) - x_hat * (y * x_hat).mean(-1, keepdim=True))


def _dual_form_head(q, k, v, eta, key, w, b, state, scale, eps, chunk):
    """One sequence, one head: q, k, v [T, D]; eta, key [T]; state (W1, b1, W2, b2) with
    biases [1, F], [1, D]. Returns o [T, D] (query_residual) and the final state."""
    W1, b1, W2, b2 = state
    outputs = []
    for s in range(0, q.shape[0], chunk):
        xq, x1, xv = q[s:s + chunk] * scale, k[s:s + chunk], v[s:s + chunk]
        lr = eta[s:s + chunk, None] * key[None, s:s + chunk]            # [L, L]: eta_i * l_j
        z1 = x1 @ W1 + b1
        x2 = _gelu(z1)
        g2 = _ln_l2_bwd(x2 @ W2 + b2, xv - x1, w, b, eps)
        g1 = g2 @ W2.T * _gelu_bwd(z1)
        z1_bar = xq @ W1 - (lr * torch.tril(xq @ x1.T)) @ g1 + b1 - torch.tril(lr) @ g1
        x2_bar = _gelu(z1_bar)
        z2_bar = x2_bar @ W2 - (lr * torch.tril(x2_bar @ x2.T)) @ g2 + b2 - torch.tril(lr) @ g2
        last = lr[-1][:, None]                                          # [L, 1]
        W1, b1 = W1 - (last * x1).T @ g1, b1 - (last * g1).sum(0, keepdim=True)
        W2, b2 = W2 - (last * x2).T @ g2, b2 - (last * g2).sum(0, keepdim=True)
        outputs.append(q[s:s + chunk] + _ln(z2_bar, eps) * w + b)
    return torch.cat(outputs), (W1, b1, W2, b2)


def _dual_form(q, k, v, w, b, eta, state, scale, eps, chunk, eta_key):
    """The dual form over a dense batch: o [B, T, H, D], finals as the oracle's."""
    B, T, H, D = q.shape
    outs, finals = [], [[] for _ in state]
    for n in range(B):
        heads = [_dual_form_head(q[n, :, h], k[n, :, h], v[n, :, h], eta[n, :, h, 0],
                                 eta_key[n, :, h, 0], w[h], b[h],
                                 [s[n, h] for s in state], scale, eps, chunk)
                 for h in range(H)]
        outs.append(torch.stack([o for o, _ in heads], dim=1))
        for i, parts in enumerate(finals):
            parts.append(torch.stack([f[i] for _, f in heads]))
    return torch.stack(outs), [torch.stack(parts) for parts in finals]


def _inputs(B, T, H, D, F, seed):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=g, dtype=F64)).requires_grad_()

    k = torch.randn(B, T, H, D, generator=g, dtype=F64)
    tensors = dict(q=rand(B, T, H, D), k=(k / k.norm(dim=-1, keepdim=True)).requires_grad_(),
                   v=rand(B, T, H, D), w=(1 + rand(H, D, s=0.1)).detach().requires_grad_(),
                   b=rand(H, D, s=0.1),
                   eta=(0.2 * torch.rand(B, T, H, 1, generator=g, dtype=F64)).requires_grad_(),
                   eta_key=(0.5 + torch.rand(B, T, H, 1, generator=g, dtype=F64))
                   .requires_grad_())
    state = [rand(B, H, D, F, s=D ** -0.5), rand(B, H, 1, F, s=0.1),
             rand(B, H, F, D, s=F ** -0.5), rand(B, H, 1, D, s=0.1)]
    return tensors, state


def _assert_agree(results, expected, inputs, state, tol, grad_tol, seed):
    """``results`` (o and the final state) equal ``expected`` within ``tol``, and so do the
    gradients of every input and initial state tensor, for the same random cotangents,
    within ``grad_tol``."""
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(x.shape, generator=g, dtype=F64) for x in results]
    leaves = [*inputs.values(), *state]
    grads = torch.autograd.grad(results, leaves, cot)
    grads_ref = torch.autograd.grad(expected, leaves, cot)
    for name, got, want in zip([*inputs, "W1", "b1", "W2", "b2"], grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=grad_tol, atol=grad_tol, msg=name)


@pytest.mark.parametrize(("B", "T", "H", "D", "F", "chunk", "scale"), [
    (2, 37, 2, 8, 32, 16, 1.0),       # hidden 4 D, partial last chunk
    (1, 40, 3, 16, 32, 8, 0.25),      # hidden 2 D, scaled queries
    (1, 5, 1, 4, 16, 16, 1.0),        # one partial chunk
])
def test_oracle_equals_the_official_dual_form(B, T, H, D, F, chunk, scale):
    t, state = _inputs(B, T, H, D, F, seed=B * 100 + T)
    eps = 1e-6
    o, finals = oracle_chunk_ttt_mlp(t["q"], t["k"], t["v"], t["w"], t["b"], t["eta"],
                                     state, scale, eps, chunk, eta_key=t["eta_key"],
                                     output="query_residual")
    o_ref, finals_ref = _dual_form(t["q"], t["k"], t["v"], t["w"], t["b"], t["eta"], state,
                                   scale, eps, chunk, t["eta_key"])
    _assert_agree((o, *finals), (o_ref, *finals_ref), t, state, 1e-12, 1e-10, seed=7)


def test_packed_batch_equals_each_sequence_alone():
    t, state = _inputs(1, 30, 2, 8, 32, seed=3)
    cu = torch.tensor([0, 11, 11, 30])
    packed_state = [torch.cat([s, s.flip(-1), 0.5 * s]).detach() for s in state]
    o, finals = oracle_chunk_ttt_mlp(t["q"], t["k"], t["v"], t["w"], t["b"], t["eta"],
                                     packed_state, None, 1e-6, 16, cu, eta_key=t["eta_key"])
    for n, (start, stop) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {name: x[:, start:stop] if x.dim() == 4 else x for name, x in t.items()}
        alone, finals_alone = oracle_chunk_ttt_mlp(
            part["q"], part["k"], part["v"], part["w"], part["b"], part["eta"],
            [s[n:n + 1] for s in packed_state], None, 1e-6, 16, eta_key=part["eta_key"])
        torch.testing.assert_close(o[:, start:stop], alone, rtol=0, atol=0)
        for got, want in zip(finals, finals_alone):
            torch.testing.assert_close(got[n:n + 1], want, rtol=0, atol=0)
    # the empty sequence keeps its initial state
    for got, initial in zip(finals, packed_state):
        torch.testing.assert_close(got[1], initial[1], rtol=0, atol=0)


@pytest.mark.parametrize("output", ["norm_residual", "query_residual", "raw"])
@pytest.mark.parametrize("packed", [False, True])
def test_reference_matches_the_oracle(output, packed):
    """ttt.reference_mlp (the dual form in PyTorch) against the oracle in float64: outputs,
    final states and every gradient, dense and packed (an empty sequence among them)."""
    from ttt.reference_mlp import chunk_ttt_mlp

    t, state = _inputs(1 if packed else 2, 37, 2, 8, 32, seed=11)
    cu = torch.tensor([0, 14, 14, 37]) if packed else None
    if packed:
        state = [torch.cat([s, 0.5 * s, s.flip(-1)]).detach().requires_grad_() for s in state]
    args = (t["q"], t["k"], t["v"], t["w"], t["b"], t["eta"], state, 0.5, 1e-6, 16, cu)
    o, finals = chunk_ttt_mlp(*args, eta_key=t["eta_key"], output=output)
    o_ref, finals_ref = oracle_chunk_ttt_mlp(*args, eta_key=t["eta_key"], output=output)
    _assert_agree((o, *finals), (o_ref, *finals_ref), t, state, 1e-11, 1e-9, seed=5)


def test_reference_in_float32_with_half_inputs():
    """bf16 inputs compute in float32: close to the float64 oracle of the rounded inputs."""
    from ttt.reference_mlp import chunk_ttt_mlp

    t, state = _inputs(1, 40, 2, 16, 64, seed=21)
    half = {n: x.detach().to(torch.bfloat16) for n, x in t.items()}
    f64 = {n: x.double() for n, x in half.items()}
    state = [s.detach().float() for s in state]
    o, finals = chunk_ttt_mlp(*(half[n] for n in ("q", "k", "v", "w", "b", "eta")), state,
                              eta_key=half["eta_key"])
    o_ref, finals_ref = oracle_chunk_ttt_mlp(*(f64[n] for n in ("q", "k", "v", "w", "b", "eta")),
                                             [s.double() for s in state],
                                             eta_key=f64["eta_key"])
    assert o.dtype == torch.bfloat16 and all(f.dtype == torch.float32 for f in finals)
    torch.testing.assert_close(o.double(), o_ref, rtol=2e-2, atol=2e-2)
    for got, want in zip(finals, finals_ref):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
