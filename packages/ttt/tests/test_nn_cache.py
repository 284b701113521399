"""Generation with ttt.nn.TTTCache: prefill + decode equals one forward over the sequence;
no autograd graph kept across steps (unless asked for); beam reordering (``reorder``) equal
to decoding the reordered batch from scratch."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import ttt.nn.layer as layer_module
from ttt.nn import TTTMLP, TTTCache, TTTLinear

FP32_RTOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _layer(K=4, use_gate=True, seed=0, kind=TTTLinear) -> TTTLinear:
    torch.manual_seed(seed)
    layer = kind(32, 4, K, use_gate=use_gate, rope_theta=100.0)
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


@pytest.mark.parametrize("kind", [TTTLinear, TTTMLP], ids=["linear", "mlp"])
@pytest.mark.parametrize("prefill", [1, 3, 4, 5, 8, 11])
@torch.no_grad()
def test_prefill_then_decode_equals_one_forward(prefill, kind):
    layer = _layer(kind=kind)
    x = torch.randn(2, 14, 32)
    cache = TTTCache()
    got = _in_pieces(layer, x, [prefill] + [1] * (14 - prefill), cache)
    assert _rel(got, layer(x)) < FP32_RTOL
    assert cache.seen_tokens == 14 and len(cache) == 1


@pytest.mark.parametrize("kind", [TTTLinear, TTTMLP], ids=["linear", "mlp"])
@torch.no_grad()
def test_prefills_of_any_length_in_a_row(kind):
    layer = _layer(use_gate=False, seed=1, kind=kind)
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


def _stored(cache: TTTCache, layer) -> list[torch.Tensor]:
    entry = cache.get(layer)
    return [*entry.states, entry.q, entry.k, entry.v, entry.eta_key]


def test_the_cache_stores_no_graph_with_gradients_enabled():
    layer, cache = _layer(), TTTCache()
    for length in (6, 1, 1):                # full mini-batches and pending tokens
        layer(torch.randn(2, length, 32), cache=cache)
        for t in _stored(cache, layer):
            assert t.grad_fn is None and not t.requires_grad


def test_the_cache_does_not_keep_earlier_steps_alive():
    """A step's input is saved by its autograd graph (the projections' backward); once the
    step's output is dropped, nothing the cache holds keeps that graph, or the input, alive."""
    layer, cache = _layer(), TTTCache()
    x = torch.randn(2, 6, 32, requires_grad=True)
    alive = weakref.ref(x)
    y = layer(x, cache=cache)
    del x, y
    gc.collect()
    assert alive() is None
    assert layer(torch.randn(2, 1, 32), cache=cache).shape == (2, 1, 32)


def test_requires_grad_keeps_the_history_across_calls():
    layer, cache = _layer(), TTTCache(requires_grad=True)
    x = torch.randn(2, 6, 32, requires_grad=True)
    layer(x, cache=cache)
    assert any(t.grad_fn is not None for t in _stored(cache, layer))
    layer(torch.randn(2, 1, 32), cache=cache).square().sum().backward()   # step 2's loss only
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_no_grad_decoding_matches_a_forward():
    layer, cache = _layer(), TTTCache()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        got = torch.cat([layer(x[:, :5], cache=cache)]
                        + [layer(x[:, t:t + 1], cache=cache) for t in range(5, 9)], dim=1)
        assert _rel(got, layer(x)) < FP32_RTOL


@pytest.mark.parametrize("prefill", [3, 4, 6])
@pytest.mark.parametrize("beam_idx", [[2, 0, 0], [1, 2, 0], [0, 0, 1, 1, 2, 2], [1]])
@torch.no_grad()
def test_reorder_equals_decoding_the_reordered_batch_from_scratch(prefill, beam_idx):
    model = _Stack()
    x = torch.randn(3, prefill, 32)
    steps = torch.randn(len(beam_idx), 5, 32)
    cache = TTTCache()
    model(x, cache=cache)
    cache.reorder(torch.tensor(beam_idx))
    got = torch.cat([model(steps[:, t:t + 1], cache=cache) for t in range(5)], dim=1)

    fresh = TTTCache()
    model(x[beam_idx], cache=fresh)
    want = torch.cat([model(steps[:, t:t + 1], cache=fresh) for t in range(5)], dim=1)
    assert _rel(got, want) < 1e-6            # (not bitwise: BLAS differs by batch size)
    assert cache.batch_size == len(beam_idx) and cache.seen_tokens == prefill + 5


@torch.no_grad()
def test_reorder_takes_a_list_and_leaves_the_old_tensors_alone():
    layer, cache = _layer(), TTTCache()
    layer(torch.randn(2, 5, 32), cache=cache)
    before = [t.clone() for t in _stored(cache, layer)]
    old = _stored(cache, layer)
    cache.reorder([1, 0])
    for t, b, new in zip(old, before, _stored(cache, layer)):
        assert torch.equal(t, b)                # not modified in place
        assert torch.equal(new, b[[1, 0]])


def test_reorder_of_an_empty_cache_does_nothing():
    cache = TTTCache()
    cache.reorder(torch.tensor([0, 0]))
    assert len(cache) == 0 and cache.batch_size is None


@pytest.mark.parametrize("beam_idx, error, words", [
    (torch.tensor([0.0, 1.0]), TypeError, "integer dtype"),
    (torch.tensor([[0, 1]]), ValueError, "1-d"),
    (torch.tensor([], dtype=torch.int64), ValueError, "non-empty"),
    (torch.tensor([0, 2]), ValueError, r"\[0, 2\).*from 0 to 2"),
    (torch.tensor([-1, 0]), ValueError, "from -1 to 0"),
    ("01", TypeError, "beam_idx"),
    ([0, 1.5], TypeError, "beam_idx"),
])
@torch.no_grad()
def test_bad_beam_idx(beam_idx, error, words):
    layer, cache = _layer(), TTTCache()
    layer(torch.randn(2, 3, 32), cache=cache)
    with pytest.raises(error, match=rf"beam_idx: .*{words}" if words != "beam_idx" else words):
        cache.reorder(beam_idx)


def test_bad_requires_grad():
    with pytest.raises(TypeError, match="requires_grad: expected a bool"):
        TTTCache(requires_grad="yes")
