"""No GPU needed: the shipped conformance suite, every test of it, through the cupy backend
on CPU tensors, with each kernel launch run by the CPU emulation.

The suite's tests are collected from ``ttt.testing`` (``ttt.testing.suite_tests``: every
``test_*`` module's, so a test added to the suite runs here too), with this module's fixtures
in place of the plugin's: ``ttt_backend`` is :class:`EmulatedCupyBackend`, registered with
``ttt.register_backend`` under its name for this module's tests, on the CPU.

Everything between the public op and the kernels is the product's own: ``ttt.chunk_ttt_linear``,
the custom ops and their eager shortcut, ``CupyBackend.forward`` / ``backward`` and the
launcher (its buffers, plans and reductions). Only the device seam differs
(``CupyBackend.launch_device``: conftest's ``EmulatedDevice``), so a plumbing fault that would
fail on the GPU (a returned tensor aliasing another, a gradient in the wrong dtype or shape,
a launch argument out of place) fails here. What the emulation cannot run, the backend
declares, and the suite skips those cases with its reasons: the emulation runs the kernels'
float32 SIMT instances, so this backend takes float32 inputs (with parameters and eta in any
float dtype: the launcher casts them; the half-precision instances run in
test_cpu_emulation.py and on the GPU), at the head dims and chunk sizes whose instances it
builds; the suite's CUDA-only tests skip on the CPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from device_stand_ins import EmulatedDevice

import ttt
from ttt import Problem
from ttt.testing import suite_tests
from ttt.testing import test_decode as decode_suite
from ttt.testing.cases import F32, Case
from ttt_cupy import placement
from ttt_cupy.backend import CupyBackend
from ttt_cupy.compile import d_pad

SUITE = suite_tests()
globals().update(SUITE)

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
    """The emulated backend, registered under its name for this module's tests."""
    backend = EmulatedCupyBackend(emu)
    with ttt.register_backend(backend.name, backend):
        yield backend


@pytest.fixture(scope="module")
def ttt_backend_name(ttt_backend) -> str:
    return ttt_backend.name


@pytest.fixture(scope="module")
def ttt_device() -> torch.device:
    return torch.device("cpu")


def test_every_suite_test_runs_here():
    """Each of the suite's tests is this module's (none shadowed by one of its own)."""
    tests = {name for name in SUITE if name.startswith("test")}
    assert tests and all(globals()[name] is SUITE[name] for name in tests)


def _step_kernel(rows: int, D: int) -> str:
    """The emulated entry point of a float32 generation step of at most ``rows`` rows per
    sequence: fwd_decode up to placement.ROW_STEP_ROWS, the fused chain past them."""
    return "emu_fwd_decode" if rows <= placement.ROW_STEP_ROWS else "emu_fwd_chain_fused"


DECODE_PAST_ROWS = [  # generation steps of 17 to 32 rows in a chunk of 32: the fused chain
    Case(2, 20, 2, 32, 32, F32),
    Case(1, 31, 2, 32, 32, F32, seq_lens=(3, 1, 20, 7)),
    Case(1, 25, 2, 32, 32, F32, seq_lens=(1, 24), eta_tensor=False, final_state=False),
]
"""(The suite's float32 steps are all at chunk 16, within ROW_STEP_ROWS: fwd_decode.)"""


@pytest.mark.parametrize("case", [c for c in decode_suite.DECODE_CASES if c.dtype == F32]
                         + DECODE_PAST_ROWS, ids=lambda c: c.id)
def test_decode_step_runs_its_kernel(case, ttt_backend, ttt_backend_name, ttt_device):
    """Generation steps (every sequence within one chunk, no gradient), against the oracle:
    fwd_decode up to placement.ROW_STEP_ROWS rows (placement.row_step), the fused forward
    chain past them (in a chunk of 32)."""
    ttt_backend.ran.clear()
    decode_suite.test_decode_step_matches_oracle(case, ttt_backend, ttt_backend_name,
                                                 ttt_device)
    assert ttt_backend.ran == [_step_kernel(max(case.seq_lens or (case.T,)), case.D)]


MULTI_STEP_PAST_ROWS = [  # chunk 64: the prefill's 37 tokens and each step one open chunk
    Case(2, decode_suite.PREFILL + decode_suite.STEPS, 2, 16, 64, F32),
]


@pytest.mark.parametrize("case", [c for c in decode_suite.MULTI_STEP_CASES if c.dtype == F32]
                         + MULTI_STEP_PAST_ROWS, ids=lambda c: c.id)
def test_one_token_steps_run_their_kernels(case, ttt_backend, ttt_backend_name, ttt_device):
    """A prefill, then steps of the open chunk's tokens so far (6 to 10 rows at chunk 16 and
    32: fwd_decode; 38 to 42 at chunk 64: the fused chain), against one call."""
    ttt_backend.ran.clear()
    decode_suite.test_decode_after_prefill_one_token_steps(case, ttt_backend, ttt_backend_name,
                                                           ttt_device)
    prefill, steps = decode_suite.PREFILL, decode_suite.STEPS
    open_rows = prefill % case.chunk   # the prefill's tokens in the open chunk
    assert ttt_backend.ran[-steps:] == [_step_kernel(open_rows + step, case.D)
                                        for step in range(1, steps + 1)]
