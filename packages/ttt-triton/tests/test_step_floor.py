"""``benchmarks.step_floor``'s kernel computes the forward chain step it times: its state
after a few steps equals the same steps in float64 PyTorch (interpreter on CPU, float32)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.step_floor import chain_steps, inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _steps_f64(k, v, w, b, h, steps, eta, eps):
    k, v, w, b, W = (x.double() for x in (k, v, w, b, h))
    hb = torch.zeros(W.shape[0], 1, W.shape[-1], dtype=torch.float64)
    for _ in range(steps):
        z = k @ W + hb
        mu = z.mean(-1, keepdim=True)
        rstd = 1 / torch.sqrt(((z - mu) ** 2).mean(-1, keepdim=True) + eps)
        xh = (z - mu) * rstd
        y = (xh * w + b - v + k) * w
        g = rstd * (y - y.mean(-1, keepdim=True) - xh * (y * xh).mean(-1, keepdim=True))
        W = W - eta * k.transpose(1, 2) @ g
        hb = hb - eta * g.sum(1, keepdim=True)
    return W + hb


@pytest.mark.parametrize("D, BT", [(16, 16), (32, 16)])
def test_chain_steps_match_float64(D, BT):
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the Triton interpreter")
    k, v, w, b, h = inputs(2, BT, D, torch.float32, DEVICE, seed=1)
    want = _steps_f64(k.cpu(), v.cpu(), w.cpu(), b.cpu(), h.cpu(), 3, 0.5, 1e-6)
    chain_steps(k, v, w, b, h, 3, eta=0.5)
    torch.testing.assert_close(h.cpu().double(), want, rtol=1e-4, atol=1e-5)
