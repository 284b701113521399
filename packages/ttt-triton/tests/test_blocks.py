"""Small checkpoint intervals and block sizes (``TTT_TRITON_TUNE``) against the float64
reference: several groups per sequence and several chunks per block, which the shared
suite's small cases only reach with the default G = 16, S = 64 on longer sequences.
Runs on CUDA when there is a GPU, else in the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

import ttt  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)


def _tune(settings: str) -> str:
    """A test's TTT_TRITON_TUNE: the run's own settings (e.g. ``chain_stages=2`` when a whole
    suite is run under a candidate tuning), then the test's, which win where they overlap."""
    return ",".join(filter(None, (os.environ.get("TTT_TRITON_TUNE", ""), settings)))


F64 = torch.float64


def _inputs(T, H, D, seq_lens, seed):
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
    cu = None
    if seq_lens:
        cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int64)
    return x, cu


def _run(x, cu, chunk, backend, dtype, device):
    state_dtype = F64 if dtype == F64 else torch.float32
    leaves = {n: t.detach().to(device, state_dtype if n.startswith("initial") else dtype)
              .clone().requires_grad_() for n, t in x.items()}
    o, ht, hbt = ttt.chunk_ttt_linear(
        **leaves, chunk_size=chunk, output_final_state=True,
        cu_seqlens=None if cu is None else cu.to(device), backend=backend)
    g = torch.Generator().manual_seed(7)
    cot = [torch.randn(t.shape, generator=g, dtype=F64).to(device, t.dtype) for t in (o, ht, hbt)]
    loss = sum((t * c).sum() for t, c in zip((o, ht, hbt), cot))
    loss.backward()
    outs = {"o": o, "ht": ht, "hbt": hbt}
    outs.update({f"d{n}": t.grad for n, t in leaves.items()})
    return {n: t.detach().to("cpu", F64) for n, t in outs.items()}


@pytest.mark.parametrize("tune,chunk,seq_lens", [
    # 2 chunks per block, 2 blocks per group, 3 groups
    ("G=4,S_out=32,S_local=32,S_grads=32", 16, None),
    # blocks clamped to the group (32 rows), varlen
    ("G=2,S_out=64,S_local=64,S_grads=64", 16, (37, 50, 1)),
    # 4 chunks per block
    ("G=4,S_out=64,S_local=64,S_grads=64", 16, (70, 33)),
    # S below the chunk: one chunk per block
    ("G=2,S_out=16,S_local=16,S_grads=16", 32, None),
])
def test_small_groups_and_blocks(monkeypatch, tune, chunk, seq_lens):
    monkeypatch.setenv("TTT_TRITON_TUNE", _tune(tune))
    T = sum(seq_lens) if seq_lens else 165
    x, cu = _inputs(T, 2, 32, seq_lens, seed=11)
    want = _run(x, cu, chunk, "reference", F64, "cpu")
    got = _run(x, cu, chunk, "triton", torch.float32, DEVICE)
    for name, ref in want.items():
        err = (got[name] - ref).norm() / ref.norm()
        assert err < 1e-4, f"{name}: relative error {err:.2e} with {tune}"


def _forward_only(x, cu, chunk, backend, dtype, device):
    state_dtype = F64 if dtype == F64 else torch.float32
    args = {n: t.to(device, state_dtype if n.startswith("initial") else dtype)
            for n, t in x.items()}
    with torch.no_grad():
        outs = ttt.chunk_ttt_linear(**args, chunk_size=chunk, output_final_state=True,
                                    cu_seqlens=None if cu is None else cu.to(device),
                                    backend=backend)
    return {n: t.to("cpu", F64) for n, t in zip(("o", "ht", "hbt"), outs)}


@pytest.mark.parametrize("fuse,with_grad", [
    ("fuse=0", False), ("fuse=1", False),                 # forward only
    ("fuse=0,fuse_bwd=0", True), ("fuse=1,fuse_bwd=1", True), ("fuse=0,fuse_bwd=1", True),
])
@pytest.mark.parametrize("chunk,seq_lens", [(16, None), (32, (37, 50, 1))])
def test_fused_chains(monkeypatch, fuse, with_grad, chunk, seq_lens):
    """The chains doing the parallel kernels' work (forward: the outputs, backward: dk, dv
    and the last-row deta) and the split kernels, with and without a backward, against the
    float64 reference: partial last chunks, varlen, initial states, several groups."""
    monkeypatch.setenv("TTT_TRITON_TUNE", _tune(f"{fuse},G=2"))
    T = sum(seq_lens) if seq_lens else 85
    x, cu = _inputs(T, 2, 32, seq_lens, seed=13)
    run = _run if with_grad else _forward_only
    want = run(x, cu, chunk, "reference", F64, "cpu")
    got = run(x, cu, chunk, "triton", torch.float32, DEVICE)
    assert set(got) == set(want)
    for name, ref in want.items():
        err = (got[name] - ref).norm() / ref.norm()
        assert err < 1e-4, f"{name}: relative error {err:.2e} with {fuse}"


HALF_DOTS_NEED_GPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="bf16/fp16 dots need the GPU (the interpreter's bf16 tl.dot is wrong)")


def _split_and_fused_errors(monkeypatch, run, x, cu, dtype, tune):
    """Relative errors {0: split, 1: fused} -> {name: err} of ``run`` (:func:`_run` or
    :func:`_forward_only`) against the float64 reference; ``tune`` formats ``fuse``."""
    want = run(x, cu, 16, "reference", F64, "cpu")
    errs = {}
    for fuse in (0, 1):
        monkeypatch.setenv("TTT_TRITON_TUNE", _tune(tune.format(fuse=fuse)))
        got = run(x, cu, 16, "triton", dtype, DEVICE)
        errs[fuse] = {n: ((got[n] - ref).norm() / ref.norm()).item() for n, ref in want.items()}
    return errs


@HALF_DOTS_NEED_GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_forward_half(monkeypatch, dtype):
    """Half inputs: the fused and the split forward agree with the float64 reference about
    as well as each other (the fused one takes q k^T as a half-precision dot too)."""
    x, _ = _inputs(200, 4, 64, None, seed=5)
    errs = _split_and_fused_errors(monkeypatch, _forward_only, x, None, dtype, "fuse={fuse}")
    for name in errs[1]:
        assert errs[1][name] < 2e-2, f"{name}: fused relative error {errs[1][name]:.2e}"
        assert errs[1][name] < 2 * errs[0][name] + 1e-3, (name, errs)


@HALF_DOTS_NEED_GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_chains_half_with_backward(monkeypatch, dtype):
    """Half inputs with a backward: outputs, final states and every gradient of the fused
    chains agree with the float64 reference about as well as the split kernels'."""
    x, cu = _inputs(150, 3, 64, (60, 90), seed=9)
    errs = _split_and_fused_errors(monkeypatch, _run, x, cu, dtype,
                                   "fuse={fuse},fuse_bwd={fuse},G=2")
    for name in errs[1]:
        assert errs[1][name] < 1e-1, f"{name}: fused relative error {errs[1][name]:.2e}"
        assert errs[1][name] < 2 * errs[0][name] + 1e-3, (name, errs)
