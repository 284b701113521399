"""No GPU needed: a small set of the shipped conformance suite's cases through the cupy
backend, on CPU tensors, with each kernel launch run by the CPU emulation.

Everything between the public op and the kernels is the product's own: ``ttt.chunk_ttt_linear``,
the custom ops and their eager shortcut, ``CupyBackend.forward`` / ``backward`` and the
launcher (its buffers, plans and reductions). Only the device seam differs
(``CupyBackend.launch_device``: conftest's ``EmulatedDevice``), so a plumbing fault that would
fail on the GPU (a returned tensor aliasing another, a gradient in the wrong dtype or shape,
a launch argument out of place) fails here. The emulation runs the kernels' float32 SIMT
instances, so this backend takes float32 inputs (with parameters and eta in any float dtype:
the launcher casts them); the half-precision instances run in test_cpu_emulation.py and on
the GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from device_stand_ins import EmulatedDevice

from ttt import Problem, registry
from ttt.testing import test_against_oracle as oracle_suite
from ttt.testing import test_decode as decode_suite
from ttt.testing import test_empty_and_meta as empty_suite
from ttt.testing import test_fresh_outputs as fresh_suite
from ttt.testing import test_properties as property_suite
from ttt.testing import test_pytorch_integration as integration_suite
from ttt.testing.cases import F32, Case, oracle_params
from ttt_cupy import placement
from ttt_cupy.backend import CupyBackend
from ttt_cupy.compile import d_pad

EMULATED_SHAPES = {16: (16, 32, 64), 32: (16, 32), 64: (16, 32), 128: (16, 32, 64)}
"""Padded head dim -> chunk sizes whose SIMT instances the emulation builds
(cpu_emulation/harness.cpp, ``INSTANCES``)."""

EMULATED_VARIANT_SHAPES = {(16, 16), (32, 16), (64, 16), (128, 64)}
"""(padded head dim, chunk size) whose instances of every variant (eta_key, the output forms)
the emulation builds (harness.cpp, ``kAllVariants``); elsewhere only the default variant's."""


class EmulatedCupyBackend(CupyBackend):
    """The cupy backend with its launches run by the CPU emulation, on CPU tensors."""

    name = "cupy-emulated"
    capabilities = replace(CupyBackend.capabilities, devices=frozenset({"cpu"}),
                           dtypes=frozenset({torch.float32}),
                           notes=("the cupy backend, its kernels run by the CPU emulation",))

    def __init__(self, emu) -> None:
        self.emu = emu
        self.ran: list[str] = []   # the emulated entry points its launches ran, every call's

    def unavailable_reason(self) -> str | None:
        return None

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        why = super().not_supported_reasons(problem)
        chunks = EMULATED_SHAPES.get(d_pad(problem.D), ()) if problem.D <= 128 else ()
        if problem.chunk_size not in chunks:
            why.append(f"head dim {problem.D} with chunk_size {problem.chunk_size}: no "
                       f"emulated instance")
        elif ((problem.eta_key is not None or problem.output != "norm_residual")
              and (d_pad(problem.D), problem.chunk_size) not in EMULATED_VARIANT_SHAPES):
            why.append(f"head dim {problem.D} with chunk_size {problem.chunk_size}: no "
                       f"emulated instance with eta_key or output {problem.output!r}")
        return why

    def launch_device(self, problem: Problem) -> EmulatedDevice:
        device = EmulatedDevice(self.emu)
        device.ran = self.ran
        device.inputs = [t for t in (problem.q, problem.k, problem.v, problem.w, problem.b,
                                     problem.eta, problem.initial_state,
                                     problem.initial_state_bias, problem.cu_seqlens)
                         if isinstance(t, torch.Tensor)]
        return device


@pytest.fixture(scope="module")
def ttt_backend(emu):
    """The emulated backend, registered under its name for the op's calls."""
    backend = EmulatedCupyBackend(emu)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(registry._LOADED, backend.name, backend)
        yield backend


@pytest.fixture(scope="module")
def ttt_backend_name(ttt_backend) -> str:
    return ttt_backend.name


@pytest.fixture(scope="module")
def ttt_device() -> torch.device:
    return torch.device("cpu")


EVERY_VARIANT = ("B2-T37-H2-D32-c16-fp32-h0-etaT",
                 "varlen[20,25]-T45-H2-D32-c16-fp32-h0-etaT-s1-eps0.01")
"""The cases run with every gradient variant (the others with all gradients at once)."""


def _small_float32(param) -> bool:
    case, variant = param.values
    return (case.dtype == F32 and case.T <= 130 and case.D <= 64 and case.H <= 2
            and (variant.name == "all" or case.id in EVERY_VARIANT))


ORACLE_PARAMS = [p for p in oracle_params() if _small_float32(p)]


@pytest.mark.parametrize(("case", "variant"), ORACLE_PARAMS)
def test_matches_oracle(case, variant, ttt_backend, ttt_backend_name, ttt_device):
    """The suite's float32 oracle cases of up to 130 tokens: dense and packed, with and
    without initial states, partial chunks, non-default scale and eps; two of them with
    every gradient variant."""
    oracle_suite.test_matches_oracle(case, variant, ttt_backend, ttt_backend_name, ttt_device)


@pytest.mark.parametrize("case", [c for c in oracle_suite.FORWARD_ONLY_CASES
                                  if c.dtype == F32], ids=lambda c: c.id)
def test_forward_only_matches_oracle(case, ttt_backend, ttt_backend_name, ttt_device):
    oracle_suite.test_forward_only_matches_oracle(case, ttt_backend, ttt_backend_name,
                                                  ttt_device)


@pytest.mark.parametrize("params", [None, torch.bfloat16, torch.float16],
                         ids=["same", "bf16-params", "fp16-params"])
@pytest.mark.parametrize("case", list(fresh_suite._CASES.values()), ids=list(fresh_suite._CASES))
def test_backend_returns_share_no_storage(case, params, ttt_backend, ttt_device):
    """Parameters and eta in half precision or float32 beside float32 activations."""
    fresh_suite.test_backend_returns_share_no_storage(case, F32, params, ttt_backend,
                                                      ttt_device)


@pytest.mark.parametrize("case", list(integration_suite.OPCHECK_CASES))
def test_opcheck_forward(case, ttt_backend, ttt_backend_name, ttt_device):
    integration_suite.test_opcheck_forward(integration_suite.OPCHECK_CASES[case],
                                           ttt_backend, ttt_backend_name, ttt_device)


@pytest.mark.parametrize(("name", "final_cotangents"), integration_suite.BACKWARD_CASES,
                         ids=[f"{n}-{'dht' if f else 'no_dht'}"
                              for n, f in integration_suite.BACKWARD_CASES])
def test_opcheck_backward(name, final_cotangents, ttt_backend, ttt_backend_name, ttt_device):
    integration_suite.test_opcheck_backward(name, final_cotangents, ttt_backend,
                                            ttt_backend_name, ttt_device)


@pytest.mark.parametrize("case", list(integration_suite.OPCHECK_CASES))
def test_eager_shortcut_equals_the_dispatcher_path(case, ttt_backend, ttt_backend_name,
                                                   ttt_device):
    integration_suite.test_eager_shortcut_equals_the_dispatcher_path(
        integration_suite.OPCHECK_CASES[case], ttt_backend, ttt_backend_name, ttt_device)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_bitwise_deterministic(varlen, ttt_backend, ttt_backend_name, ttt_device):
    property_suite.test_bitwise_deterministic(F32, varlen, ttt_backend, ttt_backend_name,
                                              ttt_device)


def test_varlen_equals_each_sequence_alone(ttt_backend, ttt_backend_name, ttt_device):
    property_suite.test_varlen_equals_each_sequence_alone(F32, ttt_backend, ttt_backend_name,
                                                          ttt_device)


def test_inputs_are_not_modified(ttt_backend, ttt_backend_name, ttt_device):
    property_suite.test_inputs_are_not_modified(F32, ttt_backend, ttt_backend_name,
                                                ttt_device)


def test_strided_views_give_the_contiguous_results(ttt_backend, ttt_backend_name, ttt_device):
    property_suite.test_strided_views_give_the_contiguous_results(F32, ttt_backend,
                                                                  ttt_backend_name, ttt_device)


def _step_kernel(rows: int, D: int) -> str:
    """The emulated entry point of a float32 generation step of at most ``rows`` rows per
    sequence: fwd_decode up to placement.ROW_STEP_ROWS, the fused chain past them."""
    most = placement.ROW_STEP_ROWS["float32_wide" if d_pad(D) > 64 else "float32"]
    return "emu_fwd_decode" if rows <= most else "emu_fwd_chain_fused"


DECODE_PAST_ROWS = [  # generation steps of 17 to 32 rows in a chunk of 32: the fused chain
    Case(2, 20, 2, 32, 32, F32),
    Case(1, 31, 2, 32, 32, F32, seq_lens=(3, 1, 20, 7)),
    Case(1, 25, 2, 32, 32, F32, seq_lens=(1, 24), eta_tensor=False, final_state=False),
]
"""(The suite's float32 steps are all at chunk 16, within ROW_STEP_ROWS: fwd_decode.)"""


@pytest.mark.parametrize("case", [c for c in decode_suite.DECODE_CASES if c.dtype == F32]
                         + DECODE_PAST_ROWS, ids=lambda c: c.id)
def test_decode_step_matches_oracle(case, ttt_backend, ttt_backend_name, ttt_device):
    """Generation steps (every sequence within one chunk, no gradient): fwd_decode up to
    placement.ROW_STEP_ROWS rows (placement.row_step), the fused forward chain past them
    (in a chunk of 32)."""
    ttt_backend.ran.clear()
    decode_suite.test_decode_step_matches_oracle(case, ttt_backend, ttt_backend_name,
                                                 ttt_device)
    assert ttt_backend.ran == [_step_kernel(max(case.seq_lens or (case.T,)), case.D)]


MULTI_STEP_PAST_ROWS = [  # chunk 64: the prefill's 37 tokens and each step one open chunk
    Case(2, decode_suite.PREFILL + decode_suite.STEPS, 2, 16, 64, F32),
]


@pytest.mark.parametrize("case", [c for c in decode_suite.MULTI_STEP_CASES if c.dtype == F32]
                         + MULTI_STEP_PAST_ROWS, ids=lambda c: c.id)
def test_decode_after_prefill_one_token_steps(case, ttt_backend, ttt_backend_name, ttt_device):
    """A prefill, then steps of the open chunk's tokens so far (6 to 10 rows at chunk 16 and
    32: fwd_decode; 38 to 42 at chunk 64: the fused chain), against one call."""
    ttt_backend.ran.clear()
    decode_suite.test_decode_after_prefill_one_token_steps(case, ttt_backend, ttt_backend_name,
                                                           ttt_device)
    prefill, steps = decode_suite.PREFILL, decode_suite.STEPS
    open_rows = prefill % case.chunk   # the prefill's tokens in the open chunk
    assert ttt_backend.ran[-steps:] == [_step_kernel(open_rows + step, case.D)
                                        for step in range(1, steps + 1)]


@pytest.mark.parametrize("case", [c for c in empty_suite.EMPTY_CASES
                                  if c.dtype == F32 and c.final_state], ids=lambda c: c.id)
def test_empty_sequences_pass_their_states_through(case, ttt_backend, ttt_backend_name,
                                                   ttt_device):
    """Packed batches with empty sequences: the core drops them before the backend."""
    empty_suite.test_empty_sequences_pass_their_states_through(case, ttt_backend,
                                                               ttt_backend_name, ttt_device)
