"""Empty sequences are the core's: T == 0 and equal offsets in cu_seqlens never reach a
backend, and the results are those of the definition (the conformance suite checks them
against the oracle on every backend: ttt.testing.test_empty_and_meta)."""

from __future__ import annotations

import pytest
import torch

import ttt
from ttt.nn import TTTLinear
from ttt.reference import ReferenceBackend


class _Recording(ReferenceBackend):
    name = "recording"

    def __init__(self):
        self.forwards, self.backwards = [], []

    def forward(self, problem, needs_backward):
        self.forwards.append((problem.T, problem.seq_lens))
        return super().forward(problem, needs_backward)

    def backward(self, problem, saved, do, dht, dhbt, needs):
        self.backwards.append((problem.T, problem.seq_lens))
        return super().backward(problem, saved, do, dht, dhbt, needs)


@pytest.fixture
def recording(register):
    backend = _Recording()
    register("recording", backend)
    return backend


def _inputs(B, T, N=None, H=2, D=8, states=True):
    N = B if N is None else N
    inputs = dict(q=torch.randn(B, T, H, D), k=torch.randn(B, T, H, D),
                  v=torch.randn(B, T, H, D), w=torch.randn(H, D), b=torch.randn(H, D),
                  eta=0.1 * torch.rand(B, T, H, 1), chunk_size=4)
    if states:
        inputs["initial_state"] = torch.randn(N, H, D, D)
        inputs["initial_state_bias"] = torch.randn(N, H, 1, D)
    for t in inputs.values():
        if isinstance(t, torch.Tensor):
            t.requires_grad_()
    return inputs


def test_no_backend_call_without_tokens(recording):
    inputs = _inputs(2, 0)
    o, ht, hbt = ttt.chunk_ttt_linear(**inputs, output_final_state=True, backend="recording")
    (o.sum() + ht.sum() + hbt.sum()).backward()
    assert recording.forwards == [] and recording.backwards == []
    assert o.shape == (2, 0, 2, 8)
    assert torch.equal(ht, inputs["initial_state"]) and ht is not inputs["initial_state"]
    assert torch.equal(inputs["initial_state"].grad, torch.ones(2, 2, 8, 8))
    assert torch.equal(inputs["w"].grad, torch.zeros(2, 8))


def test_the_backend_gets_the_non_empty_sequences_only(recording):
    inputs = _inputs(1, 13, N=5)
    cu = torch.tensor([0, 0, 4, 4, 13, 13])
    o, ht, hbt = ttt.chunk_ttt_linear(**inputs, cu_seqlens=cu, output_final_state=True,
                                      backend="recording")
    (o.sum() + ht.sum() + hbt.sum()).backward()
    assert recording.forwards == [(13, (4, 9))] and recording.backwards == [(13, (4, 9))]
    for n in (0, 2, 4):
        assert torch.equal(ht[n], inputs["initial_state"][n])
        assert torch.equal(inputs["initial_state"].grad[n], torch.ones(2, 8, 8))


def test_packed_call_equals_the_call_without_its_empty_sequences():
    inputs = _inputs(1, 13, N=5)
    keep = [1, 3]
    o, ht, hbt = ttt.chunk_ttt_linear(**inputs, cu_seqlens=torch.tensor([0, 0, 4, 4, 13, 13]),
                                      output_final_state=True)
    alone = {**inputs, "initial_state": inputs["initial_state"][keep],
             "initial_state_bias": inputs["initial_state_bias"][keep]}
    o2, ht2, hbt2 = ttt.chunk_ttt_linear(**alone, cu_seqlens=torch.tensor([0, 4, 13]),
                                         output_final_state=True)
    assert torch.equal(o, o2)
    assert torch.equal(ht[keep], ht2) and torch.equal(hbt[keep], hbt2)


def test_without_states_empty_sequences_end_at_zero():
    inputs = _inputs(1, 6, N=3, states=False)
    _, ht, hbt = ttt.chunk_ttt_linear(**inputs, cu_seqlens=torch.tensor([0, 6, 6, 6]),
                                      output_final_state=True)
    assert not ht[1:].any() and not hbt[1:].any() and ht[0].any()
    _, ht, hbt = ttt.chunk_ttt_linear(**_inputs(3, 0, states=False), output_final_state=True)
    assert ht.shape == (3, 2, 8, 8) and not ht.any() and not hbt.any()
    assert ht.dtype == torch.float32


def test_an_empty_batch():
    o, ht, hbt = ttt.chunk_ttt_linear(**_inputs(0, 7), output_final_state=True)
    assert o.shape == (0, 7, 2, 8) and ht.shape == (0, 2, 8, 8) and hbt.shape == (0, 2, 1, 8)


def test_float64_inputs_with_float32_states_give_float64_final_states():
    inputs = _inputs(2, 0)
    inputs = {n: (t.detach().double() if n in "qkvwb" or n == "eta" else t.detach())
              if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}
    _, ht, _ = ttt.chunk_ttt_linear(**inputs, output_final_state=True)
    assert ht.dtype == torch.float64 and torch.equal(ht, inputs["initial_state"].double())


def test_still_refused():
    with pytest.raises(ValueError, match=r"cu_seqlens: expected non-decreasing"):
        ttt.chunk_ttt_linear(**_inputs(1, 6, states=False),
                             cu_seqlens=torch.tensor([0, 4, 2, 6]))
    q = torch.randn(1, 4, 0, 8)
    with pytest.raises(ValueError, match=r"q: expected \[B, T, H, D\] with H >= 1"):
        ttt.chunk_ttt_linear(q, q, q, torch.ones(0, 8), torch.zeros(0, 8), 0.1)


def test_the_backend_choice_still_errs_without_tokens():
    with pytest.raises(ttt.BackendError):
        ttt.chunk_ttt_linear(**_inputs(2, 0), backend="no_such_backend")


def test_compiled_call_without_tokens():
    inputs = _inputs(2, 0)

    def f(q, k, v, w, b, eta, h0, hb0):
        o, ht, hbt = ttt.chunk_ttt_linear(q, k, v, w, b, eta, chunk_size=4, initial_state=h0,
                                          initial_state_bias=hb0, output_final_state=True)
        return o.sum() + (ht * 2).sum() + hbt.sum()

    args = [inputs[n] for n in ("q", "k", "v", "w", "b", "eta", "initial_state",
                                "initial_state_bias")]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(*args).backward()
    assert torch.equal(inputs["initial_state"].grad, torch.full((2, 2, 8, 8), 2.0))
    assert torch.equal(inputs["q"].grad, torch.zeros(2, 0, 2, 8))


def test_layer_on_packed_sequences_with_empty_ones():
    torch.manual_seed(0)
    layer = TTTLinear(16, 2, 4)
    x = torch.randn(1, 11, 16)
    with_empty = layer(x, cu_seqlens=torch.tensor([0, 0, 5, 5, 11, 11]))
    without = layer(x, cu_seqlens=torch.tensor([0, 5, 11]))
    assert torch.equal(with_empty, without)
