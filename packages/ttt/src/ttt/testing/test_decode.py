"""Generation steps: forward-only calls (no gradient) in which every sequence fits in one
chunk, carrying initial states and returning final states, as a decoding model makes them
(kernels may take another path for them than for training or long prefills). Each is
judged against the float64 oracle, and a prefill followed by single-token steps against
one call over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from ..tolerances import TOLERANCES
from .calls import run_op, skip_unless_supported
from .cases import BF16, F16, F32, OUTPUT_FORMS, Case, make_inputs
from .compare import Judge
from .expected import OUTPUT_NAMES, oracle_forward
from .test_against_oracle import check_forward_against_oracle

LAYER_FORM = dict(eta_key=True, output="query_residual")
"""The form ``ttt.nn.TTTLinear`` calls the op in."""


def _decode_cases() -> list[Case]:
    cases = []
    for dtype in (F32, BF16, F16):
        for B in (1, 4):                                   # one token per sequence
            for eta_tensor in (True, False):
                cases.append(Case(B, 1, 2, 32, 16, dtype, eta_tensor=eta_tensor,
                                  **LAYER_FORM))
        for output in OUTPUT_FORMS:                        # every form, eta_key or not
            cases.append(Case(4, 1, 2, 32, 16, dtype, output=output,
                              eta_key=output == "raw", eta_tensor=output != "raw"))
        for lens in ((1, 1, 1), (3, 1, 16, 7)):           # packed: one token each, mixed
            cases.append(Case(1, sum(lens), 2, 32, 16, dtype, seq_lens=lens, **LAYER_FORM))
            cases.append(Case(1, sum(lens), 2, 32, 16, dtype, seq_lens=lens,
                              eta_tensor=False, output="raw"))
            cases.append(Case(1, sum(lens), 2, 32, 16, dtype, seq_lens=lens))
    cases += [
        Case(4, 1, 2, 64, 16, F32, **LAYER_FORM),          # the benchmark's head dim
        Case(2, 16, 2, 32, 16, F32, **LAYER_FORM),         # a whole chunk per sequence
        Case(2, 20, 2, 32, 32, BF16, **LAYER_FORM),        # within a longer chunk
        Case(4, 1, 2, 32, 16, F32, states=False, **LAYER_FORM),
        Case(4, 1, 2, 32, 16, F32, final_state=False, **LAYER_FORM),
        Case(1, 3, 2, 32, 16, F32, seq_lens=(1, 1, 1), states=False, final_state=False),
    ]
    return cases


DECODE_CASES = _decode_cases()


@pytest.mark.parametrize("case", [c.param() for c in DECODE_CASES])
def test_decode_step_matches_oracle(case, ttt_backend, ttt_backend_name, ttt_device):
    """One generation step (no gradient): outputs and final states against the oracle."""
    check_forward_against_oracle(case, ttt_backend, ttt_backend_name, ttt_device,
                                 seed=case.seed + 2)


PREFILL, STEPS = 37, 5
MULTI_STEP_CASES = [
    Case(2, PREFILL + STEPS, 2, 32, chunk, dtype, **form)
    for dtype in (F32, BF16, F16) for chunk in (16, 32)
    for form in (LAYER_FORM, {})
]


def _tokens(inputs: dict, start: int, stop: int, state, state_bias) -> dict:
    """The call over tokens ``start:stop`` of ``inputs`` from the given states, returning
    the final states."""
    x = dict(inputs, initial_state=state, initial_state_bias=state_bias,
             output_final_state=True)
    for name in ("q", "k", "v", "eta", "eta_key"):
        if isinstance(x.get(name), torch.Tensor):
            x[name] = x[name][:, start:stop]
    return x


@pytest.mark.parametrize("case", [c.param() for c in MULTI_STEP_CASES])
def test_decode_after_prefill_one_token_steps(case, ttt_backend, ttt_backend_name, ttt_device):
    """A prefill of 37 tokens, then 5 steps of one new token each, carrying the states as
    a generation cache does (``ttt.nn.TTTCache``): the prefill's complete chunks in one call
    whose final states are committed, its remaining tokens in one call from them; each step
    runs the open chunk's tokens so far (the new one last) from the committed states, and
    commits its final states when the chunk completes. The steps' outputs, after the
    prefill's, and the last step's final states equal one call over the 42 tokens (both
    within the dtype's bounds of the float64 oracle)."""
    inputs = make_inputs(case, ttt_device, seed=case.seed + 3)
    skip_unless_supported(ttt_backend, inputs, requires_grad=False)
    out_tol, _ = TOLERANCES[case.dtype]
    expected = dict(zip(OUTPUT_NAMES, oracle_forward(inputs)))
    state, state_bias = inputs["initial_state"], inputs["initial_state_bias"]
    committed = PREFILL - PREFILL % case.chunk
    with torch.no_grad():
        whole = run_op(ttt_backend_name, inputs)
        o, state, state_bias = run_op(ttt_backend_name,
                                      _tokens(inputs, 0, committed, state, state_bias))
        pieces = [o]
        o, ht, hbt = run_op(ttt_backend_name,
                            _tokens(inputs, committed, PREFILL, state, state_bias))
        pieces.append(o)
        for stop in range(PREFILL + 1, PREFILL + STEPS + 1):
            o, ht, hbt = run_op(ttt_backend_name,
                                _tokens(inputs, committed, stop, state, state_bias))
            pieces.append(o[:, -1:])
            if stop - committed == case.chunk:
                committed, state, state_bias = stop, ht, hbt
    stepped = (torch.cat(pieces, dim=1), ht, hbt)
    for label, outputs in (("stepped", stepped), ("one call", whole)):
        judge = Judge(case)
        judge.outputs(outputs, expected, out_tol)
        judge.check(f"{case.id} ({label}) on {ttt_backend_name}")
