"""The oracle against the definition, computed by hand: plain Python floats, per-token
inner gradients by central finite differences of the inner loss, no torch, no autograd."""

from __future__ import annotations

import math
import random

import torch

from ttt.testing.oracle import oracle_chunk_ttt_linear


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
