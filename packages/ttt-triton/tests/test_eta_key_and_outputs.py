"""The per-key factor ``eta_key`` and the output forms on every launch path a
:class:`Tuning` can force (fused and split chains, small groups and blocks, the split
bwd_grads, varlen with partial chunks), against the float64 oracle; and the backward's
``needs``: only the requested gradients, each bitwise that of the full backward, every
returned tensor fresh. Runs on CUDA when there is a GPU, else in the Triton interpreter
(float32)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

import launcher_cases as cases  # noqa: E402

import ttt  # noqa: E402
from ttt import GradNeeds  # noqa: E402
from ttt.arguments import GRAD_INPUTS  # noqa: E402
from ttt.problem import OUTPUTS  # noqa: E402
from ttt_triton.ops.ttt_linear.tuning import Tuning  # noqa: E402

cases.skip_unless_kernels_run()


def _check(T, H, D, chunk, seq_lens, seed, tuning, output, eta_key=True,
           dtype=torch.float32):
    errs = cases.oracle_errors(T, H, D, chunk, seq_lens, seed, tuning, dtype=dtype,
                               output=output, eta_key=eta_key)
    cases.assert_within_bounds(errs, dtype, f"{tuning}, {output}")


PATHS = [
    Tuning(fuse_forward=False, fuse_backward=False, checkpoint_interval=2),
    Tuning(fuse_forward=True, fuse_backward=True, checkpoint_interval=2),
    Tuning(fuse_forward=True, fuse_backward=False, checkpoint_interval=2, grads_split=2),
    Tuning(fuse_forward=False, fuse_backward=True, checkpoint_interval=4, rows_out=32,
           rows_local=32),
]
PATH_IDS = ["split-both", "fused-both", "fused-fwd-split-bwd-grads-split",
            "split-fwd-blocks-of-2-fused-bwd"]


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("tuning", PATHS, ids=PATH_IDS)
def test_eta_key_and_output_forms_on_every_path(tuning, output):
    """eta_key and each output form, varlen with partial chunks and a one-row sequence,
    several groups, against the oracle (outputs, final states, every gradient, deta_key)."""
    _check(88, 2, 32, 16, (37, 50, 1), 21, tuning, output)


@pytest.mark.parametrize("output", OUTPUTS)
def test_output_forms_without_eta_key(output):
    """Each output form alone (no eta_key), dense with a partial last chunk, blocks of two
    chunks in the split kernels."""
    tuning = Tuning(fuse_forward=False, fuse_backward=False, checkpoint_interval=4,
                    rows_out=32, rows_local=32, rows_grads=32)
    _check(85, 2, 24, 16, None, 23, tuning, output, eta_key=False)


def test_eta_key_with_blocks_of_chunks_and_chunk_32():
    """eta_key with blocks of two chunks in every group kernel at chunk 32, dense."""
    tuning = Tuning(fuse_forward=False, fuse_backward=False, checkpoint_interval=2,
                    rows_out=64, rows_local=64, rows_grads=64)
    _check(150, 2, 32, 32, None, 25, tuning, "query_residual")


@cases.NEEDS_GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("fuse", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("D,chunk", [(50, 16), (64, 32), (128, 64)])
def test_eta_key_and_output_forms_on_gpu(dtype, output, fuse, D, chunk):
    """Every dtype and output form with eta_key, fused and split chains, at an unaligned head
    dim, the IEEE K-blocked dots (float32 at D 128) and the wide backward (half inputs at D
    128, chunk 64), against the oracle within the conformance suite's bounds."""
    tuning = Tuning(fuse_forward=fuse, fuse_backward=fuse)
    _check(180, 3, D, chunk, (60, 120), 9, tuning, output, dtype=dtype)


NEEDS = {
    "q-only": GradNeeds(k=False, v=False, w=False, b=False, eta=False, initial_state=False,
                        initial_state_bias=False, eta_key=False),
    "frozen-wb": GradNeeds(w=False, b=False),
    "no-initial-state": GradNeeds(initial_state=False, initial_state_bias=False),
    "eta-key-only": GradNeeds(q=False, k=False, v=False, w=False, b=False, eta=False,
                              initial_state=False, initial_state_bias=False),
    "dv-db-deta": GradNeeds(q=False, k=False, w=False, initial_state=False,
                            initial_state_bias=False, eta_key=False),
    "dk-dw-dh0": GradNeeds(q=False, v=False, b=False, eta=False, initial_state_bias=False,
                           eta_key=False),
}


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


SAME_ON_GPU = 1e-6
"""How far (relative, in norm) a float32 gradient of a backward that computes only some may
be from the full backward's on a GPU, where the compiler may contract a multiply-add
differently once the unneeded code is gone (a few float32 roundings); the interpreter runs
the same operations, so there the two are bitwise equal."""


def _same_gradient(grad: torch.Tensor, full: torch.Tensor) -> bool:
    if cases.DEVICE == "cpu":
        return torch.equal(grad, full)
    return bool((grad - full).norm() <= SAME_ON_GPU * full.norm())


@pytest.mark.parametrize("fuse", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("output", ["norm_residual", "query_residual"])
def test_needed_gradients_are_those_of_the_full_backward(fuse, output):
    """For each pattern of needs: the needed gradients equal the full backward's (bitwise
    in the interpreter, within :data:`SAME_ON_GPU` on a GPU), the others are None, and every
    returned tensor is fresh (no storage shared with an input or with another result)."""
    tuning = Tuning(fuse_forward=fuse, fuse_backward=fuse, checkpoint_interval=2)
    T, H, D = 60, 2, 32
    x, cu = cases.inputs(T, H, D, (23, 37), 31, eta_key=True)
    p = cases.problem(x, cu, 16, output=output)
    dys = cases.cotangents(T, H, D, 2, 31)
    full = cases.launch(p, dys, tuning)
    given = [t for t in (p.q, p.k, p.v, p.w, p.b, p.eta, p.initial_state,
                         p.initial_state_bias, p.eta_key) if t is not None]
    for label, needs in NEEDS.items():
        got = cases.launch(p, dys, tuning, needs=needs)
        returned = []
        for name in GRAD_INPUTS:
            grad, want = got[f"d{name}"], full[f"d{name}"]
            if not getattr(needs, name):
                assert grad is None, f"{label}: d{name} computed though not needed"
                continue
            assert grad is not None, f"{label}: d{name} missing"
            assert _same_gradient(grad, want), f"{label}: d{name} differs from the full backward"
            returned.append((name, grad))
        for i, (name, grad) in enumerate(returned):
            assert not any(_shares_storage(grad, t) for t in given), f"{label}: d{name}"
            assert not any(_shares_storage(grad, other) for _, other in returned[i + 1:]), \
                f"{label}: d{name} shares storage with another gradient"


def test_a_float_eta_gets_no_gradient():
    """A float eta (a constant tensor, not a leaf): no deta even when every gradient is asked
    for."""
    x, cu = cases.inputs(40, 2, 16, None, 33)
    p = replace(cases.problem(x, cu, 16, output="raw"), eta_is_tensor=False)
    got = cases.launch(p, cases.cotangents(40, 2, 16, 1, 33), Tuning())
    assert got["deta"] is None and got["deta_key"] is None
    assert got["dq"] is not None and got["dinitial_state"] is not None


def test_the_backend_launches_only_what_autograd_needs(monkeypatch):
    """Through ``ttt.chunk_ttt_linear``: with only q requiring grad (frozen w, b, a float
    eta, no initial state) the backward launches bwd_local alone; dq equals that of a call
    where every input requires grad, bitwise."""
    from ttt_triton.ops.ttt_linear import launcher

    counts = {}
    for name in ("ttt_linear_bwd_local_kernel", "ttt_linear_bwd_chain_kernel",
                 "ttt_linear_bwd_grads_kernel"):
        counts[name] = cases.LaunchSpy(getattr(launcher, name))
        monkeypatch.setattr(launcher, name, counts[name])
    x, _ = cases.inputs(40, 2, 16, None, 35, eta_key=True)
    args = {n: x[n].to(cases.DEVICE, torch.float32) for n in ("q", "k", "v", "w", "b", "eta_key")}
    do = torch.randn(args["q"].shape, generator=torch.Generator().manual_seed(5)).to(cases.DEVICE)

    def dq_of(grad_leaves):
        leaves = {n: t.clone().requires_grad_(n in grad_leaves) for n, t in args.items()}
        o, _, _ = ttt.chunk_ttt_linear(**leaves, eta=0.05, chunk_size=16,
                                       output="query_residual", backend="triton")
        return torch.autograd.grad(o, [leaves[n] for n in grad_leaves], do)[0]

    dq = dq_of(["q"])
    assert [c.launches for c in counts.values()] == [1, 0, 0]
    dq_full = dq_of(["q", "k", "v", "w", "b", "eta_key"])
    assert [c.launches for c in counts.values()] == [2, 1, 1]
    assert torch.equal(dq, dq_full)
