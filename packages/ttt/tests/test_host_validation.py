"""``make_problem`` checks each argument against its rules in turn: valid arguments of other
types than the usual ones (numpy numbers, a float ``eta``, float64 states, half ``w`` and
``b``) pass and give the Problem the usual ones give; where several arguments are bad, the
first one's error is raised."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import ttt


def _inputs(dtype=torch.float32, B=2, T=3, H=2, D=8):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=gen, dtype=dtype) for _ in range(3))
    w, b = 1 + 0.1 * torch.randn(H, D, generator=gen), 0.1 * torch.randn(H, D, generator=gen)
    eta = 0.1 * torch.rand(B, T, H, 1, generator=gen)
    return [q, k, v, w, b, eta]


def _step_options(dtype=torch.float32, B=2, H=2, D=8):
    return dict(initial_state=torch.zeros(B, H, D, D, dtype=dtype),
                initial_state_bias=torch.zeros(B, H, 1, D, dtype=dtype),
                eta_key=torch.full((B, 3, H, 1), 0.5), output_final_state=True,
                output="query_residual", scale=0.5, eps=1e-5, chunk_size=4)


def _same(a: ttt.Problem, b: ttt.Problem) -> None:
    for f in dataclasses.fields(ttt.Problem):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y), f.name
        else:
            assert type(x) is type(y) and x == y, f.name


def test_numpy_numbers_give_the_problem_of_python_numbers():
    usual = ttt.make_problem(*_inputs(), **_step_options())
    numpy_numbers = {**_step_options(), "scale": np.float64(0.5), "eps": np.float32(1e-5),
                     "chunk_size": np.int64(4)}
    converted = ttt.make_problem(*_inputs(), **numpy_numbers)
    _same(usual, dataclasses.replace(converted, eps=usual.eps))
    assert type(converted.eps) is float and converted.eps == float(np.float32(1e-5))
    assert type(converted.chunk_size) is int and type(converted.scale) is float


@pytest.mark.parametrize("scale", [None, 2, 0.25])
def test_scale_defaults_and_converts(scale):
    problem = ttt.make_problem(*_inputs(), scale=scale)
    assert type(problem.scale) is float
    assert problem.scale == (8 ** -0.5 if scale is None else float(scale))


def test_valid_arguments_outside_the_common_case_pass():
    double = [x.double() for x in _inputs(torch.float64)]
    problem = ttt.make_problem(*double, **_step_options(torch.float64))
    assert problem.initial_state.dtype == torch.float64
    floats = ttt.make_problem(*_inputs()[:5], 0.1, eta_key=torch.rand(2, 3, 2, 1))
    assert not floats.eta_is_tensor and floats.eta.shape == (2, 3, 2, 1)
    halves = _inputs()
    halves[3], halves[4] = halves[3].half(), halves[4].bfloat16()    # any floating w, b
    assert ttt.make_problem(*halves).w.dtype == torch.float16


def test_requires_grad_is_read_from_every_input():
    for name in ("eta_key", "initial_state", "initial_state_bias"):
        options = _step_options()
        options[name].requires_grad_(True)
        assert ttt.make_problem(*_inputs(), **options).requires_grad, name
    assert not ttt.make_problem(*_inputs(), **_step_options()).requires_grad
    inputs = _inputs()
    inputs[5].requires_grad_(True)
    assert ttt.make_problem(*inputs).requires_grad
    with torch.no_grad():
        assert not ttt.make_problem(*inputs).requires_grad


@pytest.mark.parametrize("bad, error, words", [
    (dict(q=torch.zeros(2, 3, 0, 8)), ValueError, r"q: expected \[B, T, H, D\] with H >= 1"),
    (dict(k=torch.zeros(2, 3, 2, 8).half(), v=None), TypeError, "k: expected dtype float32"),
    (dict(k=torch.zeros(2, 3, 2, 4), scale=-1.0), ValueError, "k, v"),
    (dict(v=torch.zeros(2, 3, 2, 16)), ValueError, "k, v"),
    (dict(w=torch.zeros(3, 8), b=torch.zeros(2, 8, dtype=torch.int32)), ValueError, "w:"),
    (dict(w=torch.zeros(3, 8), eta="x"), ValueError, "w:"),
    (dict(eta="x", output="nope"), TypeError, "eta:"),
    (dict(eta_key=1.0, scale=0.0), TypeError, "eta_key:"),
    (dict(output="nope", scale=0.0), ValueError, "output:"),
    (dict(scale=0.0, eps=-1.0), ValueError, "scale:"),
    (dict(eps=float("inf"), chunk_size=0), ValueError, "eps:"),
    (dict(chunk_size=True, output_final_state="yes"), TypeError, "chunk_size:"),
    (dict(output_final_state=1, initial_state=torch.zeros(1)), TypeError,
     "output_final_state:"),
    (dict(initial_state=torch.zeros(2, 2, 8, 8, dtype=torch.float16)), TypeError,
     "initial_state:"),
    (dict(initial_state_bias=torch.zeros(2, 2, 8, 1)), ValueError, "initial_state_bias:"),
])
def test_the_first_bad_argument_is_named(bad, error, words):
    names = ("q", "k", "v", "w", "b", "eta")
    args = {**dict(zip(names, _inputs())), **bad}
    tensors = [args.pop(name) for name in names]
    with pytest.raises(error, match=words):
        ttt.make_problem(*tensors, **args)
