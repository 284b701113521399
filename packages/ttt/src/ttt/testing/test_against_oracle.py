"""Outputs, both final states and every gradient against the float64 oracle."""

from __future__ import annotations

import pytest
import torch

from ..tolerances import TOLERANCES
from .calls import gradients, outputs_for_loss, run_op, skip_unless_supported
from .cases import (
    BF16,
    F16,
    F32,
    Case,
    Variant,
    differentiable_names,
    make_inputs,
    oracle_params,
    with_requires_grad,
)
from .compare import Judge
from .expected import OUTPUT_NAMES, expected_for, oracle_forward


@pytest.mark.parametrize(("case", "variant"), oracle_params())
def test_matches_oracle(case: Case, variant: Variant, ttt_backend, ttt_backend_name,
                        ttt_device):
    """One call, its loss through the variant's outputs, gradients of the variant's inputs:
    every output, final state and gradient against the oracle."""
    check_against_oracle(case, variant, ttt_backend, ttt_backend_name, ttt_device)


def check_against_oracle(case: Case, variant: Variant, backend, backend_name: str,
                         device) -> None:
    """``case`` called through ``backend_name`` with the gradients ``variant`` asks for:
    outputs, final states and gradients (dtype, shape, values) against the oracle."""
    names = variant.grads or differentiable_names(case)
    probe = with_requires_grad(make_inputs(case, device), names)
    skip_unless_supported(backend, probe)
    expected = expected_for(case, str(device))
    out_tol, grad_tol = TOLERANCES[case.dtype]
    inputs = with_requires_grad(expected.inputs, names)

    outputs = run_op(backend_name, inputs)
    judge = Judge(case)
    judge.outputs(outputs, expected.outputs, out_tol)
    used, cotangents = outputs_for_loss(outputs, expected.cotangents, variant.cotangents)
    grads = gradients(inputs, used, cotangents)
    want = expected.grads(variant.cotangents)
    for name, grad in grads.items():
        judge.dtype(f"d{name}", grad, inputs[name].dtype)
        if grad is not None and tuple(grad.shape) != tuple(inputs[name].shape):
            judge.fail(f"d{name}: shape {tuple(grad.shape)}, expected "
                       f"{tuple(inputs[name].shape)}")
            continue
        judge.close(f"d{name}", grad, want[name], grad_tol,
                    per_sequence_rows=name.startswith("initial_state"),
                    segments=name not in ("w", "b"))
    judge.check(f"{case.id} [{variant.name}] on {backend_name}")


FORWARD_ONLY_CASES = [
    Case(2, 50, 2, 32, 16, dtype) for dtype in (F32, BF16, F16)
] + [
    Case(1, 70, 2, 32, chunk, dtype, seq_lens=(5, 16, 49))
    for chunk in (16, 64) for dtype in (F32, BF16, F16)
] + [Case(1, 50, 2, 32, 16, F32, scale=0.3, eps=1e-2)]


@pytest.mark.parametrize("case", [c.param() for c in FORWARD_ONLY_CASES])
def test_forward_only_matches_oracle(case, ttt_backend, ttt_backend_name, ttt_device):
    """Inference: no input requires grad (kernels may take another path than training)."""
    check_forward_against_oracle(case, ttt_backend, ttt_backend_name, ttt_device,
                                 seed=case.seed + 1)


def check_forward_against_oracle(case: Case, backend, backend_name: str, device,
                                 seed: int) -> None:
    """``case``'s inputs (of ``seed``) called through ``backend_name`` without gradients:
    outputs and final states against the oracle."""
    inputs = make_inputs(case, device, seed=seed)
    skip_unless_supported(backend, inputs, requires_grad=False)
    out_tol, _ = TOLERANCES[case.dtype]
    with torch.no_grad():
        outputs = run_op(backend_name, inputs)
    expected = dict(zip(OUTPUT_NAMES, oracle_forward(inputs)))
    judge = Judge(case)
    judge.outputs(outputs, expected, out_tol)
    judge.check(f"{case.id} on {backend_name}")
