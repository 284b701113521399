"""A float ``eta`` on the CPU: one constant tensor per value, shape and dtype, made once;
never one that was written to (inside inference mode too), never an inference tensor."""

from __future__ import annotations

import torch

import ttt


def _inputs(T: int = 16, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, 2, 8, generator=gen) for _ in range(3))
    w, b = 1 + 0.1 * torch.randn(2, 8, generator=gen), 0.1 * torch.randn(2, 8, generator=gen)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, w, b)]


def test_a_float_eta_is_made_once_per_value_and_shape():
    first = ttt.make_problem(*_inputs(), 0.25).eta
    assert ttt.make_problem(*_inputs(), 0.25).eta is first
    assert torch.equal(first, torch.full((1, 16, 2, 1), 0.25))
    other_value = ttt.make_problem(*_inputs(), 0.5).eta
    assert torch.equal(other_value, torch.full((1, 16, 2, 1), 0.5))
    other_shape = ttt.make_problem(*_inputs(T=5), 0.25).eta
    assert torch.equal(other_shape, torch.full((1, 5, 2, 1), 0.25))
    double = ttt.make_problem(*[x.double() for x in _inputs()], 0.25).eta
    assert double.dtype == torch.float64


def test_a_constant_written_to_is_not_used_again():
    written = ttt.make_problem(*_inputs(), 0.125).eta
    written.add_(1.0)
    again = ttt.make_problem(*_inputs(), 0.125).eta
    assert again is not written
    assert torch.equal(again, torch.full((1, 16, 2, 1), 0.125))


def test_signed_zeros_keep_their_sign():
    for zero in (0.0, -0.0, 0.0):
        eta = ttt.make_problem(*_inputs(), zero).eta
        assert bool(torch.signbit(eta).all()) == (str(zero) == "-0.0")


def test_a_constant_made_in_inference_mode_serves_autograd_after():
    with torch.inference_mode():
        inside = ttt.make_problem(*_inputs(), 0.375).eta
        assert not inside.is_inference()
        ttt.chunk_ttt_linear(*_inputs(), 0.375, backend="reference")
        inside.mul_(2.0)
        again = ttt.make_problem(*_inputs(), 0.375).eta
        assert again is not inside and torch.equal(again, torch.full((1, 16, 2, 1), 0.375))
    inputs = _inputs(requires_grad=True)
    o, _, _ = ttt.chunk_ttt_linear(*inputs, 0.375, backend="reference")
    o.sum().backward()
    assert all(x.grad is not None for x in inputs)
