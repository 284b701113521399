"""The custom ops ttt::chunk_ttt_linear_fwd / _bwd in the core: the reference gradients
bitwise against autograd through its computation, autograd semantics (absent cotangents,
gradient dtypes), the backend's choice under torch.compile, autocast of mixed input dtypes
and under compile. opcheck, torch.compile and autocast against eager and CUDA graphs for
every backend: the conformance suite (``ttt.testing.test_pytorch_integration``)."""

from __future__ import annotations

import pytest
import torch

import ttt
from ttt import reference
from ttt.arguments import GRAD_INPUTS
from ttt.oracle import oracle_chunk_ttt_linear
from ttt.tolerances import TOLERANCES

H, D, CHUNK = 2, 8, 16


def _inputs(*, varlen=False, states=True, tensor_eta=True, eta_key=False, dtype=torch.float32,
            requires_grad=True, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    B, T, cu = (1, 45, torch.tensor([0, 7, 30, 45])) if varlen else (2, 37, None)
    N = 3 if varlen else B
    x = dict(q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, H, D),
             w=1 + 0.3 * randn(H, D, dt=torch.float32), b=0.3 * randn(H, D, dt=torch.float32),
             eta=(0.05 + 0.1 * torch.rand(B, T, H, 1, generator=gen)).to(dtype)
             if tensor_eta else 0.1,
             eta_key=(0.5 + torch.rand(B, T, H, 1, generator=gen)).to(dtype) if eta_key else None,
             initial_state=0.3 * randn(N, H, D, D, dt=torch.float32) if states else None,
             initial_state_bias=0.3 * randn(N, H, 1, D, dt=torch.float32) if states else None)
    for t in x.values():
        if isinstance(t, torch.Tensor):
            t.requires_grad_(requires_grad)
    return dict(x, cu_seqlens=cu)


def _call(x: dict, **kwargs):
    return ttt.chunk_ttt_linear(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"],
                                chunk_size=CHUNK, initial_state=x["initial_state"],
                                initial_state_bias=x["initial_state_bias"],
                                cu_seqlens=x["cu_seqlens"], eta_key=x["eta_key"], **kwargs)


def _problem(x: dict, **kwargs):
    return ttt.make_problem(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"],
                            chunk_size=CHUNK, initial_state=x["initial_state"],
                            initial_state_bias=x["initial_state_bias"],
                            cu_seqlens=x["cu_seqlens"], eta_key=x["eta_key"], **kwargs)


CASES = {
    "dense": dict(),
    "varlen": dict(varlen=True),
    "no_states": dict(states=False),
    "float_eta": dict(tensor_eta=False),
    "eta_key": dict(eta_key=True),
    "varlen_eta_key_no_states": dict(varlen=True, eta_key=True, states=False),
}


def _assert_near(got: torch.Tensor, want: torch.Tensor, bound: float) -> None:
    """Compiled against eager: relative error ||got - want|| / ||want|| (inductor may sum in
    another order), the bound of the inputs' dtype in ttt.tolerances."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < bound, err


def _grads(x: dict, outputs, cotangents):
    leaves = [n for n in GRAD_INPUTS if isinstance(x[n], torch.Tensor) and x[n].requires_grad]
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if c is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], [x[n] for n in leaves],
                                [c for _, c in pairs], allow_unused=True)
    return {n: torch.zeros_like(x[n]) if g is None else g for n, g in zip(leaves, grads)}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_gradients_equal_autograd_through_reference_compute(case):
    """The op's reference gradients are bitwise those of autograd through the reference
    computation itself (how the reference backend differentiated before the custom op)."""
    x = _inputs(**case, dtype=torch.float64)
    got = _call(x, output_final_state=True, backend="reference")
    cot = [torch.randn_like(t) for t in got]
    problem = _problem(x, output_final_state=True)
    want = reference.compute(problem, x["q"], x["k"], x["v"], x["w"], x["b"], problem.eta,
                             x["initial_state"], x["initial_state_bias"], x["eta_key"])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    got_grads, want_grads = _grads(x, got, cot), _grads(x, want, cot)
    assert set(got_grads) == set(want_grads)
    for name in got_grads:
        assert torch.equal(got_grads[name], want_grads[name]), name


@pytest.mark.parametrize("used", ["o", "final_state", "final_state_bias"])
def test_missing_cotangents(used):
    """Only one of the three outputs is used: the others' cotangents are absent (None), and
    the gradients equal the oracle's for that output alone."""
    x = {n: t.detach().double().requires_grad_(True) if isinstance(t, torch.Tensor) and
         t.is_floating_point() else t for n, t in _inputs(eta_key=True).items()}
    out = dict(zip(("o", "final_state", "final_state_bias"), _call(x, output_final_state=True)))
    cotangent = torch.randn(out[used].shape, generator=torch.Generator().manual_seed(5),
                            dtype=torch.float64)
    grads = _grads(x, [out[used]], [cotangent])
    x64 = {n: t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and
           t.is_floating_point() else t for n, t in x.items()}
    ref = dict(zip(out, oracle_chunk_ttt_linear(
        x64["q"], x64["k"], x64["v"], x64["w"], x64["b"], x64["eta"], chunk_size=CHUNK,
        initial_state=x64["initial_state"], initial_state_bias=x64["initial_state_bias"],
        eta_key=x64["eta_key"])))
    ref_grads = _grads(x64, [ref[used]], [cotangent])
    for name, grad in grads.items():
        ref_norm = ref_grads[name].norm()
        if ref_norm == 0:                    # (q does not reach the final states)
            assert grad.norm() == 0, name
            continue
        assert (grad - ref_grads[name]).norm() / ref_norm < TOLERANCES[torch.float64][1], name


def test_autograd_semantics():
    """Gradients in each input's dtype, None for inputs without requires_grad, none for a
    float eta, and no input modified."""
    x = _inputs(tensor_eta=False, eta_key=True)
    x["w"] = x["w"].detach().double().requires_grad_(True)     # any float dtype
    x["b"] = x["b"].detach().half().requires_grad_(True)
    x["v"] = x["v"].detach()                                    # no gradient wanted
    before = {n: t.detach().clone() for n, t in x.items() if isinstance(t, torch.Tensor)}
    o, ht, hbt = _call(x, output_final_state=True)
    (o.square().sum() + ht.sum() + hbt.sum()).backward()
    for name in GRAD_INPUTS:
        t = x[name]
        if not isinstance(t, torch.Tensor):
            continue
        if name == "v":
            assert t.grad is None
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert t.grad.shape == t.shape and t.grad.abs().sum() > 0, name
    for name, value in before.items():
        assert torch.equal(x[name].detach(), value), name


def test_no_grad_returns_plain_tensors():
    x = _inputs()
    with torch.no_grad():
        o, ht, hbt = _call(x, output_final_state=True)
    assert not o.requires_grad and o.grad_fn is None
    o, ht, hbt = _call(_inputs(requires_grad=False))
    assert ht is None and hbt is None and o.grad_fn is None


def test_compile_function_and_set_backend_context():
    """A compiled function sees the backend chosen by set_backend when it is traced."""
    torch._dynamo.reset()
    x = _inputs(states=False)

    def fn(q, k, v, w, b, eta):
        o, _, _ = ttt.chunk_ttt_linear(q, k, v, w, b, eta, chunk_size=CHUNK)
        return o

    args = [x[n] for n in ("q", "k", "v", "w", "b", "eta")]
    with ttt.set_backend("reference"):
        got = torch.compile(fn, fullgraph=True)(*args)
        want = fn(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _autocast_inputs():
    return _inputs(states=True, eta_key=True)


def test_autocast_casts_mixed_q_k_v():
    """In a CPU bf16 autocast region, q, k, v go in as bf16 (o comes out bf16), everything
    else keeps its dtype; an fp32 F.normalize(k) next to bf16 q, v works."""
    x = _autocast_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = x["q"].to(torch.bfloat16)
        k = torch.nn.functional.normalize(x["k"], dim=-1)          # fp32 under autocast
        assert k.dtype == torch.float32
        args = dict(x, q=q, k=k, v=x["v"].to(torch.bfloat16))
        o, ht, hbt = _call(args, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    plain = dict(args, k=k.to(torch.bfloat16))
    o_ref, ht_ref, hbt_ref = _call(plain, output_final_state=True)
    for a, b in ((o, o_ref), (ht, ht_ref), (hbt, hbt_ref)):
        assert torch.equal(a, b)
    (o.float().sum() + ht.sum()).backward()
    for name in ("q", "k", "v", "w", "b", "eta", "eta_key", "initial_state"):
        assert x[name].grad is not None and x[name].grad.dtype == x[name].dtype, name


def test_autocast_outside_keeps_dtypes():
    x = _autocast_inputs()
    o, _, _ = _call(x)
    assert o.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert _call(x)[0].dtype == torch.float32


def test_autocast_leaves_float64_alone():
    x = _inputs(dtype=torch.float64, states=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _, _ = _call(x)
    assert o.dtype == torch.float64


def test_autocast_under_compile_equals_eager():
    torch._dynamo.reset()
    x = _autocast_inputs()

    def fn(q, k, v, w, b, eta, eta_key, h0):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o, ht, _ = ttt.chunk_ttt_linear(q, torch.nn.functional.normalize(k, dim=-1), v,
                                            w, b, eta, chunk_size=CHUNK, initial_state=h0,
                                            output_final_state=True, eta_key=eta_key)
        return o, ht

    args = [x[n] for n in ("q", "k", "v", "w", "b", "eta", "eta_key", "initial_state")]
    eager = fn(*args)
    got = torch.compile(fn, fullgraph=True)(*args)
    assert got[0].dtype == torch.bfloat16
    for a, b in zip(got, eager):
        _assert_near(a, b, TOLERANCES[torch.bfloat16][0])


def test_compile_reports_an_unfit_backend(register):
    """A backend that cannot take the call is refused while tracing, with its reasons."""
    torch._dynamo.reset()

    class NoEtaKey(ttt.Backend):
        name = "no_eta_key"
        capabilities = ttt.Capabilities(devices=frozenset({"cpu"}),
                                        dtypes=frozenset({torch.float32}))

    x = _inputs(eta_key=True, states=False)

    def fn(x):
        return _call(x, backend="no_eta_key")[0]

    register("no_eta_key", NoEtaKey())
    with pytest.raises(Exception, match="eta_key") as err:     # (dynamo wraps the error)
        torch.compile(fn, fullgraph=True)(x)
    assert "torch.compile traced the call" in str(err.value)
