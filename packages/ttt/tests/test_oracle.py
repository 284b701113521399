"""The oracle against the definition, computed by hand: plain Python floats, per-token
inner gradients by central finite differences of the inner loss, no torch, no autograd."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ttt.oracle import oracle_chunk_ttt_linear


def _ln(x, eps):
    mean = sum(x) / len(x)
    var = sum((a - mean) ** 2 for a in x) / len(x)
    return [(a - mean) / math.sqrt(var + eps) for a in x]


def _inner_loss(W, hb, k, v, w, b, eps):
    D = len(k)
    pred = [sum(k[i] * W[i][j] for i in range(D)) + hb[j] for j in range(D)]
    z = _ln(pred, eps)
    return 0.5 * sum((z[j] * w[j] + b[j] - (v[j] - k[j])) ** 2 for j in range(D))


def _fd_grads(W, hb, k, v, w, b, eps, h=1e-6):
    D = len(k)
    gW = [[0.0] * D for _ in range(D)]
    for i in range(D):
        for j in range(D):
            Wp = [row[:] for row in W]
            Wm = [row[:] for row in W]
            Wp[i][j] += h
            Wm[i][j] -= h
            gW[i][j] = (_inner_loss(Wp, hb, k, v, w, b, eps)
                        - _inner_loss(Wm, hb, k, v, w, b, eps)) / (2 * h)
    ghb = []
    for j in range(D):
        hp, hm = hb[:], hb[:]
        hp[j] += h
        hm[j] -= h
        ghb.append((_inner_loss(W, hp, k, v, w, b, eps) - _inner_loss(W, hm, k, v, w, b, eps))
                   / (2 * h))
    return gW, ghb


def _by_hand(q, k, v, eta, w, b, W, hb, scale, eps, chunk):
    """One sequence, one head: lists of floats."""
    T, D = len(q), len(q[0])
    out = []
    for start in range(0, T, chunk):
        rows = range(start, min(start + chunk, T))
        sum_gW = [[0.0] * D for _ in range(D)]
        sum_ghb = [0.0] * D
        for t in rows:
            gW, ghb = _fd_grads(W, hb, k[t], v[t], w, b, eps)
            for i in range(D):
                sum_ghb[i] += ghb[i]
                for j in range(D):
                    sum_gW[i][j] += gW[i][j]
            Wt = [[W[i][j] - eta[t] * sum_gW[i][j] for j in range(D)] for i in range(D)]
            hbt = [hb[j] - eta[t] * sum_ghb[j] for j in range(D)]
            out.append([sum(scale * q[t][i] * Wt[i][j] for i in range(D)) + hbt[j]
                        for j in range(D)])
        W, hb = Wt, hbt
    final = []
    for row in out:
        z = _ln(row, eps)
        final.append([row[j] + z[j] * w[j] + b[j] for j in range(D)])
    return final, W, hb


def test_oracle_matches_the_definition_by_hand():
    rnd = random.Random(5)
    T, D, chunk, eps, scale = 5, 3, 2, 1e-3, 0.7   # a partial last chunk of one token

    def mat(r, c, s=1.0, o=0.0):
        return [[o + s * rnd.gauss(0, 1) for _ in range(c)] for _ in range(r)]

    q, k, v = mat(T, D), mat(T, D), mat(T, D)
    w, b = mat(1, D, 0.1, 1.0)[0], mat(1, D, 0.1)[0]
    eta = [0.1 * rnd.random() for _ in range(T)]
    W0, hb0 = mat(D, D, 0.3), mat(1, D, 0.3)[0]

    o, W, hb = _by_hand(q, k, v, eta, w, b, W0, hb0, scale, eps, chunk)

    def t(x):
        return torch.tensor(x, dtype=torch.float64)

    to = oracle_chunk_ttt_linear(
        t(q)[None, :, None], t(k)[None, :, None], t(v)[None, :, None], t([w]), t([b]),
        t(eta)[None, :, None, None], scale=scale, eps=eps, chunk_size=chunk,
        initial_state=t(W0)[None, None], initial_state_bias=t([hb0])[None, None])
    o_ref, W_ref, hb_ref = to
    assert torch.allclose(o_ref[0, :, 0], t(o), atol=1e-6, rtol=1e-6)
    assert torch.allclose(W_ref[0, 0], t(W), atol=1e-6, rtol=1e-6)
    assert torch.allclose(hb_ref[0, 0, 0], t(hb), atol=1e-6, rtol=1e-6)


def _tiny_inputs(B, T, H, D, N, seed):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, generator=g, dtype=torch.float64)
                ).requires_grad_(True)

    k = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    return dict(q=rand(B, T, H, D), k=(k / k.norm(dim=-1, keepdim=True)).requires_grad_(True),
                v=rand(B, T, H, D), w=rand(H, D, scale=0.1, offset=1.0), b=rand(H, D, scale=0.1),
                eta=(0.1 * torch.rand(B, T, H, 1, generator=g, dtype=torch.float64)
                     ).requires_grad_(True),
                initial_state=rand(N, H, D, D, scale=0.3),
                initial_state_bias=rand(N, H, 1, D, scale=0.3))


@pytest.mark.parametrize("layout", ["varlen", "dense"])
def test_oracle_gradients_match_finite_differences(layout):
    """torch.autograd.gradcheck of the oracle's outputs and both final states with respect to
    every input, in float64: several heads, partial chunks, initial states, non-default
    scale and eps; packed sequences (lengths 3 and 5, chunk 2) or a dense batch."""
    if layout == "varlen":
        inputs = _tiny_inputs(1, 8, 2, 3, 2, seed=7)
        extra = dict(cu_seqlens=torch.tensor([0, 3, 8]))
    else:
        inputs = _tiny_inputs(2, 5, 2, 3, 2, seed=8)
        extra = {}
    names = list(inputs)

    def oracle(*tensors):
        return oracle_chunk_ttt_linear(**dict(zip(names, tensors)), scale=0.7, eps=1e-2,
                                       chunk_size=2, **extra)

    assert torch.autograd.gradcheck(oracle, tuple(inputs.values()), eps=1e-6, atol=1e-6,
                                    rtol=1e-5)


def test_the_cli_imports_nothing_of_the_test_package():
    import ast

    import ttt.cli

    tree = ast.parse(open(ttt.cli.__file__).read())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names]
    assert not [name for name in imported if "testing" in name.split(".")]
