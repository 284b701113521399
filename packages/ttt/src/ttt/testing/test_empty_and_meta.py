"""Empty sequences (``T == 0``, equal offsets in ``cu_seqlens``) and meta tensors.

Empty sequences are the core's: no backend sees one. Every backend is still checked, since
the non-empty sequences of a packed batch reach it without the empty ones and their final
states come back in place: outputs, final states and every gradient against the oracle,
and exactly: an empty sequence's final states are its initial states (zeros when none are
given) and its initial states' gradients are the final states' cotangents.
"""

from __future__ import annotations

import pytest
import torch

from ..tolerances import TOLERANCES
from .calls import gradients, run_op, skip_unless_supported
from .cases import (
    BF16,
    F16,
    F32,
    F64,
    GRAD_INPUTS,
    STATE_NAMES,
    VARIANTS,
    Case,
    differentiable,
    make_inputs,
)
from .compare import Judge, expect
from .expected import expected_for
from .test_against_oracle import check_against_oracle


def _empty_cases() -> list[Case]:
    cases = []
    for dtype in (F32, BF16, F16, F64):
        cases += [
            Case(2, 0, 2, 32, 16, dtype),                                    # T == 0
            Case(1, 37, 2, 32, 16, dtype, seq_lens=(0, 5, 0, 32, 0)),       # some empty
        ]
    cases += [
        Case(3, 0, 1, 16, 16, F32, states=False, eta_tensor=False),
        Case(1, 0, 2, 16, 16, F32, seq_lens=(0, 0, 0)),                     # all empty
        Case(1, 0, 2, 16, 16, F32, seq_lens=(0,), states=False),
        Case(1, 21, 2, 32, 16, F32, seq_lens=(21, 0), states=False),
        Case(1, 40, 2, 32, 32, BF16, seq_lens=(0, 40), eta_tensor=False),
        Case(1, 45, 2, 32, 16, F32, seq_lens=(20, 0, 25), eta_key=True,
             output="query_residual"),
        Case(1, 45, 2, 32, 16, F32, seq_lens=(0, 9, 36), states=False, eta_key=True,
             output="raw"),
        Case(1, 24, 2, 32, 16, F32, seq_lens=(0, 24), final_state=False),
    ]
    return cases


EMPTY_CASES = _empty_cases()


def _params() -> list:
    """Every case with the variant ``all``; the float32 ones with every variant."""
    params = []
    for case in EMPTY_CASES:
        for variant in VARIANTS if case.dtype == F32 else VARIANTS[:1]:
            if variant.applies_to(case):
                params.append(pytest.param(case, variant, id=f"{case.id}-{variant.name}",
                                           marks=[pytest.mark.xdist_group(case.id)]))
    return params


@pytest.mark.parametrize(("case", "variant"), _params())
def test_empty_sequences_match_oracle(case: Case, variant, ttt_backend, ttt_backend_name,
                                      ttt_device):
    check_against_oracle(case, variant, ttt_backend, ttt_backend_name, ttt_device)


def _empty_rows(case: Case) -> list[int]:
    if case.seq_lens is None:
        return list(range(case.N)) if case.T == 0 else []
    return [n for n, length in enumerate(case.seq_lens) if length == 0]


@pytest.mark.parametrize("case", [c.param() for c in EMPTY_CASES if c.final_state])
def test_empty_sequences_pass_their_states_through(case, ttt_backend, ttt_backend_name,
                                                   ttt_device):
    """Exactly: an empty sequence's final states are its initial states (zeros when none
    are given), new tensors; its initial states' gradients are the final states'
    cotangents; with no tokens at all every other gradient is zero."""
    inputs = differentiable(make_inputs(case, ttt_device, seed=case.seed))
    skip_unless_supported(ttt_backend, inputs)
    before = {n: t.detach().clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    o, ht, hbt = run_op(ttt_backend_name, inputs)
    expect(tuple(o.shape) == tuple(inputs["q"].shape) and o.dtype == case.dtype,
           f"o: shape/dtype {tuple(o.shape)}/{o.dtype}")
    rows = _empty_rows(case)
    g = torch.Generator(device="cpu").manual_seed(5)
    cots = [torch.randn(x.shape, generator=g).to(device=x.device, dtype=x.dtype)
            for x in (o, ht, hbt)]
    grads = gradients(inputs, [o, ht, hbt], cots)
    for name, final, cot in ((STATE_NAMES[0], ht, cots[1]), (STATE_NAMES[1], hbt, cots[2])):
        given = inputs.get(name)
        expect(final.dtype == case.state_dtype, f"{name}: final dtype {final.dtype}")
        for n in rows:
            want = (torch.zeros_like(final[n]) if given is None
                    else given[n].detach().to(case.state_dtype))
            expect(torch.equal(final[n], want),
                   f"final state of empty sequence {n} is not its initial {name}")
            if given is not None:
                expect(torch.equal(grads[name][n], cot[n].to(given.dtype)),
                       f"d{name} of empty sequence {n} is not the final state's cotangent")
        if given is not None:
            expect(final.data_ptr() != given.data_ptr() or final.numel() == 0,
                   f"the final state aliases {name}")
    if case.T == 0:
        for name in GRAD_INPUTS:
            if name in STATE_NAMES or grads.get(name) is None:
                continue
            expect(tuple(grads[name].shape) == tuple(inputs[name].shape),
                   f"d{name}: shape {tuple(grads[name].shape)}")
            expect(not grads[name].any(), f"d{name} of a call without tokens is not zero")
    for name, value in before.items():
        expect(torch.equal(inputs[name].detach(), value), f"{name} was modified")


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_empty_sequences_forward_only(dtype, ttt_backend, ttt_backend_name, ttt_device):
    case = Case(1, 37, 2, 32, 16, dtype, seq_lens=(0, 5, 0, 32, 0))
    inputs = make_inputs(case, ttt_device, seed=case.seed)
    skip_unless_supported(ttt_backend, inputs, requires_grad=False)
    with torch.no_grad():
        o, ht, hbt = run_op(ttt_backend_name, inputs)
    expected = expected_for(case, str(ttt_device))
    judge = Judge(case)
    judge.outputs((o, ht, hbt), expected.outputs, TOLERANCES[dtype][0])
    judge.check(f"{case.id} (no grad) on {ttt_backend_name}")


@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64])
def test_meta_tensors_give_shapes_and_dtypes(dtype, ttt_backend, ttt_backend_name):
    """Where the backend declares the meta device: outputs and gradients of the right
    shapes and dtypes on meta (deferred initialisation, shape tracing)."""
    if "meta" not in ttt_backend.capabilities.devices:
        pytest.skip(f"{ttt_backend_name} does not declare the meta device")
    case = Case(2, 37, 2, 32, 16, dtype, eta_key=True)
    inputs = differentiable(make_inputs(case, "meta", seed=1))
    skip_unless_supported(ttt_backend, inputs)
    o, ht, hbt = run_op(ttt_backend_name, inputs)
    for label, x, shape, want in (("o", o, (2, 37, 2, 32), dtype),
                                  ("final_state", ht, (2, 2, 32, 32), case.state_dtype),
                                  ("final_state_bias", hbt, (2, 2, 1, 32), case.state_dtype)):
        expect((x.device.type, tuple(x.shape), x.dtype) == ("meta", shape, want),
               f"{label}: {x.device.type} {tuple(x.shape)} {x.dtype}")
    grads = gradients(inputs, [o, ht, hbt], [torch.ones_like(x) for x in (o, ht, hbt)])
    for name, grad in grads.items():
        expect(grad is not None and grad.device.type == "meta"
               and grad.shape == inputs[name].shape and grad.dtype == inputs[name].dtype,
               f"d{name} on meta: {None if grad is None else (grad.shape, grad.dtype)}")
