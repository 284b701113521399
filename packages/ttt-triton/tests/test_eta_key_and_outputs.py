"""The per-key factor ``eta_key`` and the output forms on every launch path a
:class:`Tuning` can force (fused and split chains, small groups and blocks, the split
bwd_grads, varlen with partial chunks), against the float64 oracle; and the backward's
``needs``: only the requested gradients, each bitwise that of the full backward, every
returned tensor fresh. Runs on CUDA when there is a GPU, else in the Triton interpreter
(float32)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

import ttt  # noqa: E402
from ttt import GradNeeds  # noqa: E402
from ttt.oracle import oracle_chunk_ttt_linear  # noqa: E402
from ttt.problem import GRAD_INPUTS, OUTPUTS  # noqa: E402
from ttt.tolerances import TOLERANCES  # noqa: E402
from ttt_triton.ops.ttt_linear import ttt_linear_bwd, ttt_linear_fwd  # noqa: E402
from ttt_triton.ops.ttt_linear.tuning import Tuning  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

F64 = torch.float64
RESULTS = ("o", "ht", "hbt")


def _inputs(T, H, D, seq_lens, seed, eta_key=True):
    """Fresh random float64 inputs of one packed batch (B = 1) with initial states and,
    ``eta_key``, a per-key factor around one."""
    g = torch.Generator().manual_seed(seed)
    N = len(seq_lens) if seq_lens else 1
    k = torch.randn(1, T, H, D, generator=g, dtype=F64)
    x = dict(
        q=torch.randn(1, T, H, D, generator=g, dtype=F64),
        k=k / k.norm(dim=-1, keepdim=True),
        v=torch.randn(1, T, H, D, generator=g, dtype=F64),
        w=1 + 0.1 * torch.randn(H, D, generator=g, dtype=F64),
        b=0.1 * torch.randn(H, D, generator=g, dtype=F64),
        eta=0.1 * torch.rand(1, T, H, 1, generator=g, dtype=F64),
        initial_state=0.1 * torch.randn(N, H, D, D, generator=g, dtype=F64),
        initial_state_bias=0.1 * torch.randn(N, H, 1, D, generator=g, dtype=F64),
    )
    if eta_key:
        x["eta_key"] = 0.5 + torch.rand(1, T, H, 1, generator=g, dtype=F64)
    cu = None
    if seq_lens:
        cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int64)
    return x, cu


def _cotangents(T, H, D, N, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(s, generator=g, dtype=F64)
            for s in ((1, T, H, D), (N, H, D, D), (N, H, 1, D))]


def _oracle(x, cu, chunk, output, cotangents):
    """{name: float64 result}: the outputs and every gradient."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    outs = oracle_chunk_ttt_linear(**leaves, chunk_size=chunk, cu_seqlens=cu, output=output)
    want = dict(zip(RESULTS, (t.detach() for t in outs)))
    grads = torch.autograd.grad(outs, list(leaves.values()), cotangents)
    want.update({f"d{n}": g for n, g in zip(leaves, grads)})
    return want


def _problem(x, cu, chunk, output, dtype=torch.float32):
    args = {n: t.to(DEVICE, torch.float32 if n.startswith("initial") else dtype)
            for n, t in x.items()}
    return ttt.make_problem(**args, chunk_size=chunk, output_final_state=True,
                            cu_seqlens=None if cu is None else cu.to(DEVICE), output=output)


def _triton(problem, cotangents, tuning, needs=None):
    """(results {name: tensor as returned}, the problem): forward and backward under
    ``tuning`` with ``needs``."""
    o, ht, hbt, saved = ttt_linear_fwd(problem, save_for_backward=True, tuning=tuning)
    got = dict(zip(RESULTS, (o, ht, hbt)))
    do, dht, dhbt = (c.to(DEVICE, t.dtype) for c, t in zip(cotangents, (o, ht, hbt)))
    grads = ttt_linear_bwd(problem, saved, do.contiguous(), dht, dhbt, tuning=tuning,
                           needs=needs)
    gradients = ttt.Gradients(*grads)              # (the launcher returns its fields)
    got.update({f"d{n}": gradients.of(n) for n in GRAD_INPUTS})
    return got


def _check(T, H, D, chunk, seq_lens, seed, tuning, output, eta_key=True,
           dtype=torch.float32):
    x, cu = _inputs(T, H, D, seq_lens, seed, eta_key)
    x = {n: t.to(torch.float32 if n.startswith("initial") else dtype).to(F64)   # as run
         for n, t in x.items()}
    cotangents = _cotangents(T, H, D, len(seq_lens) if seq_lens else 1, seed)
    want = _oracle(x, cu, chunk, output, cotangents)
    got = _triton(_problem(x, cu, chunk, output, dtype), cotangents, tuning)
    got = {n: t.detach().to("cpu", F64) for n, t in got.items() if t is not None}
    assert set(got) == set(want)
    out_tol, grad_tol = TOLERANCES[dtype]
    errs = {n: ((got[n] - ref).norm() / ref.norm()).item() for n, ref in want.items()}
    bad = {n: f"{e:.2e} > {grad_tol if n.startswith('d') else out_tol:.0e}"
           for n, e in errs.items() if not e <= (grad_tol if n.startswith("d") else out_tol)}
    assert not bad, f"relative errors above the bounds with {tuning}, {output}: {bad}"


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


NEEDS_GPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="GPU dtypes and head dims: on CPU the tests above run every path "
    "in float32 (the interpreter's bf16 tl.dot is wrong)")


@NEEDS_GPU
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


@pytest.mark.parametrize("fuse", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("output", ["norm_residual", "query_residual"])
def test_needed_gradients_are_bitwise_those_of_the_full_backward(fuse, output):
    """For each pattern of needs: the needed gradients bitwise equal the full backward's,
    the others are None, and every returned tensor is fresh (no storage shared with an
    input or with another result)."""
    tuning = Tuning(fuse_forward=fuse, fuse_backward=fuse, checkpoint_interval=2)
    T, H, D = 60, 2, 32
    x, cu = _inputs(T, H, D, (23, 37), 31)
    problem = _problem(x, cu, 16, output)
    cotangents = _cotangents(T, H, D, 2, 31)
    full = _triton(problem, cotangents, tuning)
    inputs = [t for t in (problem.q, problem.k, problem.v, problem.w, problem.b,
                          problem.eta, problem.initial_state, problem.initial_state_bias,
                          problem.eta_key) if t is not None]
    for label, needs in NEEDS.items():
        got = _triton(problem, cotangents, tuning, needs)
        returned = []
        for name in GRAD_INPUTS:
            grad, want = got[f"d{name}"], full[f"d{name}"]
            if not getattr(needs, name):
                assert grad is None, f"{label}: d{name} computed though not needed"
                continue
            assert grad is not None, f"{label}: d{name} missing"
            assert torch.equal(grad, want), f"{label}: d{name} differs from the full backward"
            returned.append((name, grad))
        for i, (name, grad) in enumerate(returned):
            assert not any(_shares_storage(grad, t) for t in inputs), f"{label}: d{name}"
            assert not any(_shares_storage(grad, other) for _, other in returned[i + 1:]), \
                f"{label}: d{name} shares storage with another gradient"


def test_a_float_eta_gets_no_gradient():
    """A float eta (a constant tensor, not a leaf): no deta even when every gradient is asked
    for."""
    x, cu = _inputs(40, 2, 16, None, 33, eta_key=False)
    problem = replace(_problem(x, cu, 16, "raw"), eta_is_tensor=False)
    got = _triton(problem, _cotangents(40, 2, 16, 1, 33), Tuning())
    assert got["deta"] is None and got["deta_key"] is None
    assert got["dq"] is not None and got["dinitial_state"] is not None


class _LaunchCount:
    """Stands in for a kernel in the launcher: counts launches, then launches."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_the_backend_launches_only_what_autograd_needs(monkeypatch):
    """Through ``ttt.chunk_ttt_linear``: with only q requiring grad (frozen w, b, a float
    eta, no initial state) the backward launches bwd_local alone; dq equals that of a call
    where every input requires grad, bitwise."""
    from ttt_triton.ops.ttt_linear import launcher

    counts = {}
    for name in ("ttt_linear_bwd_local_kernel", "ttt_linear_bwd_chain_kernel",
                 "ttt_linear_bwd_grads_kernel"):
        counts[name] = _LaunchCount(getattr(launcher, name))
        monkeypatch.setattr(launcher, name, counts[name])
    x, _ = _inputs(40, 2, 16, None, 35)
    args = {n: x[n].to(DEVICE, torch.float32) for n in ("q", "k", "v", "w", "b", "eta_key")}
    do = torch.randn(args["q"].shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)

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
