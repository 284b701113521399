"""Properties of the per-key factor ``eta_key`` and of the output forms, for every backend
that declares them (the others skip with their declared reasons). Each form and eta_key are
also judged against the float64 oracle (``test_against_oracle``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ..tolerances import TOLERANCES
from .calls import outputs_and_grads, skip_unless_supported
from .cases import (
    BF16,
    DTYPE_NAMES,
    F16,
    F32,
    F64,
    OUTPUT_FORMS,
    Case,
    differentiable,
    make_inputs,
)
from .compare import expect, expect_close

DTYPES = [pytest.param(d, id=DTYPE_NAMES[d]) for d in (F32, BF16, F16)]
LAYOUTS = [pytest.param(None, id="dense"), pytest.param((9, 36), id="varlen")]


def _case(dtype, seq_lens) -> Case:
    """Partial last chunks (T = 37; sequences of 9 and 36), initial states."""
    if seq_lens:
        return Case(1, sum(seq_lens), 2, 32, 16, dtype, seq_lens=seq_lens)
    return Case(2, 37, 2, 32, 16, dtype)


@pytest.mark.parametrize("seq_lens", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_eta_key_of_ones_equals_none(dtype, seq_lens, ttt_backend, ttt_backend_name,
                                     ttt_device):
    """eta_key of ones is no factor: outputs, final states and every gradient equal those
    of eta_key=None. Both calls are each within the dtype's bound of the oracle, so they
    are bounded by twice that bound apart (bitwise on the reference backend:
    packages/ttt/tests/test_op_semantics.py)."""
    case = _case(dtype, seq_lens)
    plain = differentiable(make_inputs(case, ttt_device, seed=81))
    ones = dict(plain, eta_key=torch.ones_like(plain["eta"].detach()).requires_grad_(True))
    skip_unless_supported(ttt_backend, ones)
    out_tol, grad_tol = TOLERANCES[dtype]
    out_none, grads_none = outputs_and_grads(ttt_backend_name, plain)
    out_ones, grads_ones = outputs_and_grads(ttt_backend_name, ones)
    for label, a, b in zip(("o", "final_state", "final_state_bias"), out_ones, out_none):
        expect_close(label, a, b, 2 * out_tol)
    for name, grad in grads_none.items():
        expect_close(f"d{name}", grads_ones[name], grad, 2 * grad_tol)
    deta_key = grads_ones["eta_key"]
    expect(deta_key is not None and deta_key.dtype == ones["eta_key"].dtype,
           "d eta_key: missing or not in eta_key's dtype")
    expect(torch.isfinite(deta_key).all() and deta_key.abs().sum() > 0, "d eta_key")


def _outputs_and_grads_per_form(backend, backend_name, inputs):
    found = {}
    for form in OUTPUT_FORMS:
        call = dict(inputs, output=form)
        skip_unless_supported(backend, call)
        found[form] = outputs_and_grads(backend_name, call)
    return found


@pytest.mark.parametrize("seq_lens", LAYOUTS)
@pytest.mark.parametrize("dtype", [*DTYPES, pytest.param(F64, id="fp64")])
def test_output_forms_are_consistent(dtype, seq_lens, ttt_backend, ttt_backend_name,
                                     ttt_device):
    """By definition (docs/math.md) ``query_residual - q == norm_residual - raw`` (both are
    ``LN(z) * w + b``), and so, for one cotangent of ``o``, every gradient of
    ``query_residual`` is that of ``norm_residual`` minus that of ``raw`` (q's plus the
    cotangent itself). Each side is a sum of results that are each
    within the dtype's bound of the oracle: the bound is that tolerance times the sum of
    their norms, relative to the compared side's norm."""
    case = replace(_case(dtype, seq_lens), final_state=False)   # the loss reads o only
    inputs = differentiable(make_inputs(case, ttt_device, seed=91))
    found = _outputs_and_grads_per_form(ttt_backend, ttt_backend_name, inputs)
    out_tol, grad_tol = TOLERANCES[dtype]
    (o_norm,), grads_norm = found["norm_residual"]
    (o_query,), grads_query = found["query_residual"]
    (o_raw,), grads_raw = found["raw"]
    q = inputs["q"].detach().to(F64)

    def bound(tol, ref, *parts):
        return tol * sum(p.detach().to(F64).norm().item() for p in parts) / ref.norm().item()

    post_norm = o_norm.detach().to(F64) - o_raw.detach().to(F64)
    expect_close("query_residual - q against norm_residual - raw",
                 o_query.detach().to(F64) - q, post_norm,
                 bound(out_tol, post_norm, o_query, o_norm, o_raw))
    cotangent = torch.randn(o_norm.shape, generator=torch.Generator().manual_seed(7))
    cotangent = cotangent.to(device=o_norm.device, dtype=o_norm.dtype)   # as outputs_and_grads
    for name, grad in grads_query.items():
        want = grads_norm[name].to(F64) - grads_raw[name].to(F64)
        if name == "q":
            want = want + cotangent.to(F64)
        expect_close(f"d{name} of query_residual against norm_residual - raw", grad.to(F64),
                     want, bound(grad_tol, want, grad, grads_norm[name], grads_raw[name]))
