"""eta_key and the output forms in the core: eta_key=None as no factor at all (bitwise on the
reference backend), validation, capability refusal and the automatic choice. Every backend
is judged on eta_key and the output forms by the conformance suite (``ttt.testing``)."""

from __future__ import annotations

import pytest
import torch

import ttt
from ttt.problem import OUTPUTS

H, D, CHUNK = 2, 8, 16
NAMES = ("q", "k", "v", "w", "b", "eta", "eta_key", "initial_state", "initial_state_bias")


def _inputs(dtype: torch.dtype, varlen: bool, with_eta_key: bool, seed: int = 0) -> dict:
    """Fresh random inputs; partial last chunks in every sequence (T, lengths not multiples
    of CHUNK), non-zero initial states."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt)

    B, T, cu = (1, 45, torch.tensor([0, 7, 30, 45])) if varlen else (2, 37, None)
    N = 3 if varlen else B
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = dict(q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, H, D),
             w=1 + 0.3 * randn(H, D), b=0.3 * randn(H, D),
             eta=0.05 + 0.1 * torch.rand(B, T, H, 1, generator=gen, dtype=torch.float64).to(dtype),
             eta_key=(0.5 + torch.rand(B, T, H, 1, generator=gen, dtype=torch.float64).to(dtype)
                      if with_eta_key else None),
             initial_state=0.3 * randn(N, H, D, D, dt=state_dtype),
             initial_state_bias=0.3 * randn(N, H, 1, D, dt=state_dtype))
    for t in x.values():
        if t is not None:
            t.requires_grad_(True)
    return dict(x, cu_seqlens=cu)


def _cotangents(o, ht, hbt, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
            for t in (o, ht, hbt)]


def _run(fn, x: dict, output: str, **kwargs):
    """Outputs, final states and the gradients of every tensor input, from fn."""
    o, ht, hbt = fn(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"], chunk_size=CHUNK,
                    initial_state=x["initial_state"],
                    initial_state_bias=x["initial_state_bias"], cu_seqlens=x["cu_seqlens"],
                    eta_key=x["eta_key"], output=output, **kwargs)
    leaves = [n for n in NAMES if x[n] is not None]
    cot = _cotangents(o, ht, hbt)
    grads = torch.autograd.grad((o, ht, hbt), [x[n] for n in leaves], cot)
    return [o, ht, hbt], dict(zip(leaves, grads))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_eta_key_none_is_no_factor(varlen):
    """eta_key=None gives bitwise what a factor of ones gives (x * 1 is exact), and a
    non-trivial eta_key changes outputs and states."""
    x = _inputs(torch.float32, varlen, True)
    ones = dict(x, eta_key=torch.ones_like(x["eta_key"]).requires_grad_(True))
    none = dict(x, eta_key=None)
    run = dict(output_final_state=True, backend="reference")
    got_none, grads_none = _run(ttt.chunk_ttt_linear, none, "norm_residual", **run)
    got_ones, grads_ones = _run(ttt.chunk_ttt_linear, ones, "norm_residual", **run)
    got_key, _ = _run(ttt.chunk_ttt_linear, x, "norm_residual", **run)
    for a, b, c in zip(got_none, got_ones, got_key):
        assert torch.equal(a, b)
        assert not torch.allclose(a, c)
    for name, grad in grads_none.items():
        assert torch.equal(grad, grads_ones[name]), name


def _small():
    q = torch.randn(1, 20, H, D)
    return q, q.clone(), q.clone(), torch.ones(H, D), torch.zeros(H, D), 0.1


@pytest.mark.parametrize("bad", ["layer_norm", "", "RAW", None, 3])
def test_bad_output(bad):
    with pytest.raises(ValueError) as err:
        ttt.chunk_ttt_linear(*_small(), output=bad)
    message = str(err.value)
    assert message.startswith("output:")
    assert all(form in message for form in OUTPUTS)
    assert repr(bad) in message


@pytest.mark.parametrize("bad, error, words", [
    (torch.ones(1, 20, H), ValueError, "4-d"),
    (torch.ones(1, 20, H, 2), ValueError, "[B, T, H, 1]"),
    (torch.ones(1, 20, H, 1, dtype=torch.int32), TypeError, "floating dtype"),
    (torch.ones(1, 20, H, 1, device="meta"), ValueError, "device"),
    (0.5, TypeError, "float"),
])
def test_bad_eta_key(bad, error, words):
    with pytest.raises(error) as err:
        ttt.chunk_ttt_linear(*_small(), eta_key=bad)
    assert str(err.value).startswith("eta_key:")
    assert words in str(err.value)


def test_make_problem_takes_the_new_keywords():
    q, k, v, w, b, eta = _small()
    eta_key = torch.rand(1, 20, H, 1)
    p = ttt.make_problem(q, k, v, w, b, eta, eta_key=eta_key, output="raw")
    assert p.output == "raw" and p.eta_key is not None and torch.equal(p.eta_key, eta_key)
    assert not p.requires_grad
    p = ttt.make_problem(q, k, v, w, b, eta, eta_key=eta_key.requires_grad_(True))
    assert p.requires_grad and p.output == "norm_residual"


def test_capabilities_refuse_undeclared_features():
    q, k, v, w, b, eta = _small()
    caps = ttt.Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))
    assert caps.reasons(ttt.make_problem(q, k, v, w, b, eta)) == []
    why = caps.reasons(ttt.make_problem(q, k, v, w, b, eta, eta_key=torch.rand(1, 20, H, 1),
                                        output="query_residual"))
    assert len(why) == 2
    assert "eta_key" in why[0]
    assert "'query_residual'" in why[1] and "norm_residual" in why[1]
    reference = ttt.load_backend("reference").capabilities
    assert reference.eta_key and reference.outputs == frozenset(OUTPUTS)



def test_automatic_choice_passes_over_a_backend_without_the_features(monkeypatch, register):
    """A backend first in line that does not declare eta_key / the output form is skipped
    by the automatic choice (the reference backend takes the call) and refuses by name."""
    from ttt.choice import select_backend

    class Plain(ttt.Backend):
        name = "plain"
        capabilities = ttt.Capabilities(devices=frozenset({"cpu"}),
                                        dtypes=frozenset({torch.float32}))

        def forward(self, problem, needs_backward):
            raise AssertionError("the plain backend was chosen")

    register("plain", Plain(), priority=0)
    monkeypatch.delenv("TTT_BACKEND", raising=False)
    q, k, v, w, b, eta = _small()
    problem = ttt.make_problem(q, k, v, w, b, eta, output="raw")
    assert select_backend(problem).name == "reference"
    o, _, _ = ttt.chunk_ttt_linear(q, k, v, w, b, eta, eta_key=torch.rand(1, 20, H, 1))
    assert o.shape == q.shape
    with pytest.raises(ttt.BackendNotSupportedError, match="eta_key"):
        ttt.chunk_ttt_linear(q, k, v, w, b, eta, eta_key=torch.rand(1, 20, H, 1),
                             backend="plain")
