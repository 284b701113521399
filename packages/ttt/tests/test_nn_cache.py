"""Generation with ttt.nn.TTTCache: prefill + decode equals one forward over the sequence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ttt.nn.layer as layer_module
from ttt.nn import TTTCache, TTTLinear

FP32_RTOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _layer(K=4, use_gate=True, seed=0) -> TTTLinear:
    torch.manual_seed(seed)
    layer = TTTLinear(32, 4, K, use_gate=use_gate, rope_theta=100.0)
    with torch.no_grad():                    # every parameter off its initial value
        for param in layer.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return layer


def _in_pieces(model, x, lengths, cache):
    outputs, start = [], 0
    for length in lengths:
        outputs.append(model(x[:, start:start + length], cache=cache))
        start += length
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("prefill", [1, 3, 4, 5, 8, 11])
@torch.no_grad()
def test_prefill_then_decode_equals_one_forward(prefill):
    layer = _layer()
    x = torch.randn(2, 14, 32)
    cache = TTTCache()
    got = _in_pieces(layer, x, [prefill] + [1] * (14 - prefill), cache)
    assert _rel(got, layer(x)) < FP32_RTOL
    assert cache.seen_tokens == 14 and len(cache) == 1


@torch.no_grad()
def test_prefills_of_any_length_in_a_row():
    layer = _layer(use_gate=False, seed=1)
    x = torch.randn(3, 23, 32)
    got = _in_pieces(layer, x, [2, 7, 1, 1, 5, 4, 3], TTTCache())
    assert _rel(got, layer(x)) < FP32_RTOL


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_layer(seed=s) for s in range(2))

    def forward(self, x, cache=None):
        for layer in self.layers:
            x = x + layer(x, cache=cache)
        return x


@torch.no_grad()
def test_one_cache_serves_a_stack():
    model = _Stack()
    x = torch.randn(2, 10, 32)
    cache = TTTCache()
    got = _in_pieces(model, x, [6] + [1] * 4, cache)
    assert _rel(got, model(x)) < FP32_RTOL
    assert len(cache) == 2
    cache.reset()
    assert len(cache) == 0 and cache.seen_tokens == 0


@torch.no_grad()
def test_decode_runs_only_the_open_mini_batch(monkeypatch):
    """Each decode step is one operator call over the pending tokens from the committed
    state; the call that completes a mini-batch returns the state to commit."""
    calls = []
    real = layer_module.chunk_ttt_linear

    def recording(q, *args, **kwargs):
        calls.append((q.shape[1], kwargs["output_final_state"]))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(layer_module, "chunk_ttt_linear", recording)
    layer, cache = _layer(K=4), TTTCache()
    x = torch.randn(1, 10, 32)
    layer(x[:, :6], cache=cache)                  # one full mini-batch, 2 pending
    assert calls == [(4, True), (2, False)]
    calls.clear()
    for t in range(6, 10):
        layer(x[:, t:t + 1], cache=cache)
    assert calls == [(3, False), (4, True), (1, False), (2, False)]
    entry = cache.get(layer)
    assert entry.seen == 10 and entry.q.shape[1] == 2


def test_cache_keeps_gradients_when_enabled():
    layer = _layer(seed=2)
    x = torch.randn(1, 6, 32, requires_grad=True)
    cache = TTTCache()
    _in_pieces(layer, x, [5, 1], cache).square().sum().backward()
    assert x.grad is not None and layer.W1.grad is not None


def test_cache_misuse_raises():
    layer = _layer()
    cache = TTTCache()
    with torch.no_grad():
        layer(torch.randn(2, 3, 32), cache=cache)
        with pytest.raises(ValueError, match="batch size 2"):
            layer(torch.randn(3, 1, 32), cache=cache)
        with pytest.raises(ValueError, match="cu_seqlens"):
            layer(torch.randn(1, 4, 32), cache=TTTCache(), cu_seqlens=torch.tensor([0, 2, 4]))
