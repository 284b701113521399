"""Inputs, the float64 oracle and the launcher's results for the tests that call the
launcher directly under a forced :class:`Tuning` (test_forced_paths.py,
test_eta_key_and_outputs.py), and the kernel spy the launch-recording tests put in the
launcher's place. On CUDA when there is a GPU, else in the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

import ttt
from ttt.arguments import GRAD_INPUTS
from ttt.oracle import oracle_chunk_ttt_linear
from ttt.tolerances import TOLERANCES
from ttt_triton.ops.ttt_linear import ttt_linear_bwd, ttt_linear_fwd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
RESULTS = ("o", "ht", "hbt")
NEEDS_GPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="GPU dtypes and head dims: on CPU the other tests run every path "
    "in float32 (the interpreter's bf16 tl.dot is wrong)")


def skip_unless_kernels_run():
    """Skips the calling test module where the kernels cannot run: no GPU and no
    ``TRITON_INTERPRET=1``."""
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)


def inputs(T, H, D, seq_lens, seed, eta_key=False):
    """Fresh random float64 inputs of one packed batch (B = 1) with initial states and,
    ``eta_key``, a per-key factor around one; and the batch's cu_seqlens (None: dense)."""
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


def as_run(x, dtype):
    """``x`` rounded to what a call in ``dtype`` computes with (states float32), in float64."""
    return {n: t.to(torch.float32 if n.startswith("initial") else dtype).to(F64)
            for n, t in x.items()}


def cotangents(T, H, D, N, seed):
    """Random float64 cotangents of o, ht and hbt."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(s, generator=g, dtype=F64)
            for s in ((1, T, H, D), (N, H, D, D), (N, H, 1, D))]


def oracle(x, cu, chunk, cotangents, output="norm_residual", with_grad=True):
    """{name: float64 result}: the outputs and, ``with_grad``, every gradient."""
    leaves = {n: t.clone().requires_grad_(with_grad) for n, t in x.items()}
    outs = oracle_chunk_ttt_linear(**leaves, chunk_size=chunk, cu_seqlens=cu, output=output)
    want = dict(zip(RESULTS, (t.detach() for t in outs)))
    if with_grad:
        grads = torch.autograd.grad(outs, list(leaves.values()), cotangents)
        want.update({f"d{n}": g for n, g in zip(leaves, grads)})
    return want


def problem(x, cu, chunk, dtype=torch.float32, output="norm_residual"):
    """The validated problem of ``x`` in ``dtype`` (states float32) on DEVICE."""
    args = {n: t.to(DEVICE, torch.float32 if n.startswith("initial") else dtype)
            for n, t in x.items()}
    return ttt.make_problem(**args, chunk_size=chunk, output_final_state=True,
                            cu_seqlens=None if cu is None else cu.to(DEVICE), output=output)


def launch(problem, cotangents, tuning, with_grad=True, needs=None):
    """{name: tensor as the launcher returns it}: forward and, ``with_grad``, backward under
    ``tuning`` with ``needs``."""
    o, ht, hbt, saved = ttt_linear_fwd(problem, save_for_backward=with_grad, tuning=tuning)
    got = dict(zip(RESULTS, (o, ht, hbt)))
    if with_grad:
        do, dht, dhbt = (c.to(DEVICE, t.dtype) for c, t in zip(cotangents, (o, ht, hbt)))
        gradients = ttt_linear_bwd(problem, saved, do.contiguous(), dht, dhbt, tuning=tuning,
                                   needs=needs)
        got.update({f"d{n}": gradients.of(n) for n in GRAD_INPUTS})
    return got


def launch_or_skip_unfit(problem, cotangents, tuning, with_grad=True):
    """:func:`launch`, skipping the test where this GPU refuses the forced ``tuning`` (a
    kernel needing more shared memory than the device has); on the CPU a refusal fails."""
    try:
        return launch(problem, cotangents, tuning, with_grad)
    except ValueError as err:
        if DEVICE == "cpu" or "the device allows" not in str(err):
            raise
        pytest.skip(f"this device cannot run the forced configuration: {err}")


class LaunchSpy:
    """Stands in for a kernel in the launcher: records each launch's grid in ``grids`` (and
    ``(kernel, grid)`` in ``log``, when given), then launches, or with ``run=False`` does not.
    Compiling ahead (``warmup``, which a pass's first call on a GPU does for its kernels but
    the first, :mod:`~ttt_triton.ops.ttt_linear.launches`) is no launch: it goes to the
    kernel, unrecorded (with ``run=False``, it compiles nothing)."""

    def __init__(self, kernel, log: list | None = None, run: bool = True):
        self.kernel, self.log, self.run, self.grids = kernel, log, run, []

    @property
    def launches(self) -> int:
        return len(self.grids)

    def __getitem__(self, grid):
        self.grids.append(grid)
        if self.log is not None:
            self.log.append((self.kernel, grid))
        return self.kernel[grid] if self.run else (lambda *args, **kwargs: None)

    def warmup(self, *args, **kwargs):
        return self.kernel.warmup(*args, **kwargs) if self.run else None


def oracle_errors(T, H, D, chunk, seq_lens, seed, tuning, *, with_grad=True,
                  dtype=torch.float32, output="norm_residual", eta_key=False):
    """{name: relative error against the oracle} of every output and, ``with_grad``, every
    gradient of one call under ``tuning`` (:func:`launch_or_skip_unfit`) on fresh inputs
    (:func:`inputs`, with ``eta_key`` a per-key factor) as a call in ``dtype`` sees them."""
    x, cu = inputs(T, H, D, seq_lens, seed, eta_key)
    x = as_run(x, dtype)
    dys = cotangents(T, H, D, len(seq_lens) if seq_lens else 1, seed)
    want = oracle(x, cu, chunk, dys, output, with_grad)
    got = launch_or_skip_unfit(problem(x, cu, chunk, dtype, output), dys, tuning, with_grad)
    return relative_errors(got, want)


def relative_errors(got, want):
    """{name: relative error} of the launcher's results (None: not computed) against the
    oracle's; the two name the same results."""
    got = {n: t.detach().to("cpu", F64) for n, t in got.items() if t is not None}
    assert set(got) == set(want)
    return {n: ((got[n] - ref).norm() / ref.norm()).item() for n, ref in want.items()}


def assert_within_bounds(errs, dtype, what):
    """Every error within the conformance suite's bound for ``dtype`` (outputs and final
    states, gradients)."""
    out_tol, grad_tol = TOLERANCES[dtype]
    bad = {n: f"{e:.2e} > {grad_tol if n.startswith('d') else out_tol:.0e}"
           for n, e in errs.items() if not e <= (grad_tol if n.startswith("d") else out_tol)}
    assert not bad, f"relative errors above the bounds with {what}: {bad}"
