"""Outputs, final states and every gradient against the float64 oracle."""

from __future__ import annotations

import pytest
import torch

from conformance import (
    BF16,
    F16,
    F32,
    ORACLE_CASES,
    TOLERANCES,
    Case,
    check_close,
    differentiable,
    grad_leaves,
    make_inputs,
    run_op,
    run_oracle,
    skip_unless_supported,
)


@pytest.mark.parametrize("case", [c.param() for c in ORACLE_CASES])
def test_forward_backward_match_oracle(case, backend, backend_name, device):
    inputs = differentiable(make_inputs(case, device, seed=case.seed))
    skip_unless_supported(backend, inputs)
    out_tol, grad_tol = TOLERANCES[case.dtype]

    o, ht, hbt = run_op(backend_name, inputs)
    oracle_args, (ref_o, ref_ht, ref_hbt) = run_oracle(inputs)

    failures: list[str] = []
    if o.dtype != case.dtype or o.shape != inputs["q"].shape:
        failures.append(f"o: dtype/shape {o.dtype}/{tuple(o.shape)}, expected "
                        f"{case.dtype}/{tuple(inputs['q'].shape)}")
    check_close("o", o, ref_o, out_tol, failures)
    outputs, ref_outputs = [o], [ref_o]
    if case.final_state:
        state_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
        for label, x in (("final_state", ht), ("final_state_bias", hbt)):
            if x is not None and x.dtype != state_dtype:
                failures.append(f"{label}: dtype {x.dtype}, expected {state_dtype}")
        check_close("final_state", ht, ref_ht, out_tol, failures)
        check_close("final_state_bias", hbt, ref_hbt, out_tol, failures)
        outputs += [ht, hbt]
        ref_outputs += [ref_ht, ref_hbt]
    else:
        if ht is not None or hbt is not None:
            failures.append("final states returned though output_final_state=False")

    # random cotangents on o and on both final states
    g = torch.Generator(device="cpu").manual_seed(1234)
    cotangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in ref_outputs]
    leaves = grad_leaves(inputs)
    ref_leaves = [oracle_args[name] for name, _ in leaves]
    grads = torch.autograd.grad(
        outputs, [t for _, t in leaves],
        [c.to(device=x.device, dtype=x.dtype) for c, x in zip(cotangents, outputs)])
    ref_grads = torch.autograd.grad(
        ref_outputs, ref_leaves, [c.to(x.device) for c, x in zip(cotangents, ref_outputs)])
    expected = {"q", "k", "v", "w", "b"} | ({"eta"} if case.eta_tensor else set()) | (
        {"initial_state", "initial_state_bias"} if case.states else set())
    if {name for name, _ in leaves} != expected:
        failures.append(f"gradient set {sorted(n for n, _ in leaves)} != {sorted(expected)}")
    for (name, leaf), grad, ref in zip(leaves, grads, ref_grads):
        if grad is not None and grad.dtype != leaf.dtype:
            failures.append(f"d{name}: dtype {grad.dtype}, expected {leaf.dtype}")
        check_close(f"d{name}", grad, ref, grad_tol, failures)

    assert not failures, f"{case.id} on {backend_name}: " + "; ".join(failures)


FORWARD_ONLY_CASES = [
    Case(2, 50, 2, 32, 16, dtype, seq_lens=None) for dtype in (F32, BF16, F16)
] + [
    Case(1, 70, 2, 32, chunk, dtype, seq_lens=(5, 16, 49))
    for chunk in (16, 64) for dtype in (F32, BF16, F16)
]


@pytest.mark.parametrize("case", [c.param() for c in FORWARD_ONLY_CASES])
def test_forward_only_matches_oracle(case, backend, backend_name, device):
    """Inference: no input requires grad (kernels may take another path than training)."""
    inputs = make_inputs(case, device, seed=case.seed + 1)
    skip_unless_supported(backend, inputs, requires_grad=False)
    out_tol, _ = TOLERANCES[case.dtype]
    with torch.no_grad():
        o, ht, hbt = run_op(backend_name, inputs)
        _, (ref_o, ref_ht, ref_hbt) = run_oracle(inputs)
    failures: list[str] = []
    check_close("o", o, ref_o, out_tol, failures)
    check_close("final_state", ht, ref_ht, out_tol, failures)
    check_close("final_state_bias", hbt, ref_hbt, out_tol, failures)
    assert not failures, f"{case.id} on {backend_name}: " + "; ".join(failures)
