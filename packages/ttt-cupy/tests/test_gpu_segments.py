"""On a GPU: the segmented passes (launcher.segment_plan, forced with TTT_CUPY_SEGMENTS) and the
overlapped ones (launcher.overlapped, forced with TTT_CUPY_OVERLAP=1, also with the fallback
path of TTT_CUPY_OVERLAP_SPINS=0) give bitwise the outputs, final states and gradients of one
launch per kernel, for dense and varlen batches (segments past a short sequence's end), every
dtype, and on a stream of the caller's that is not the default one. Skips without a CUDA GPU
and cupy; the CPU emulation (test_cpu_emulation.py::test_segments_match_one_launch,
test_overlapped_passes_match_plain) checks the same kernels' index math on CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ttt

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
    reason="needs a CUDA GPU and cupy")

SEGMENT_ENV = "TTT_CUPY_SEGMENTS"
OVERLAP_ENV = "TTT_CUPY_OVERLAP"
SPINS_ENV = "TTT_CUPY_OVERLAP_SPINS"

CASES = [
    # B, T, H, D, dtype, varlen lengths (None: dense)
    (2, 1000, 3, 64, torch.bfloat16, None),     # 63 chunks: 4 groups
    (1, 4096, 2, 128, torch.float32, None),     # SIMT fp32, 16 groups
    (3, 700, 2, 50, torch.float16, None),       # a padded head dim
    (1, 2030, 2, 64, torch.bfloat16, [1300, 700, 30]),  # varlen: groups 6, 3 and 1
]


def _inputs(case):
    B, T, H, D, dtype, lens = case
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    N = B if lens is None else len(lens)
    x = dict(q=randn(B, T, H, D), k=torch.nn.functional.normalize(randn(B, T, H, D), dim=-1),
             v=randn(B, T, H, D), w=1 + 0.1 * randn(H, D), b=0.1 * randn(H, D),
             eta=0.1 * torch.rand(B, T, H, 1, generator=gen, device="cuda"))
    x = {n: a.to(dtype).requires_grad_() for n, a in x.items()}
    x["h0"] = (0.1 * randn(N, H, D, D)).requires_grad_()
    x["hb0"] = (0.1 * randn(N, H, 1, D)).requires_grad_()
    cu = None
    if lens is not None:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    cot = (randn(B, T, H, D), randn(N, H, D, D), randn(N, H, 1, D))
    return x, cu, cot


def _run(x, cu, cot):
    """Outputs, final states and the gradients of every input."""
    with ttt.set_backend("cupy"):
        o, ht, hbt = ttt.chunk_ttt_linear(
            x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"], initial_state=x["h0"],
            initial_state_bias=x["hb0"], output_final_state=True, cu_seqlens=cu)
    loss = (o.float() * cot[0]).sum() + (ht * cot[1]).sum() + (hbt * cot[2]).sum()
    grads = torch.autograd.grad(loss, list(x.values()))
    return [o, ht, hbt, *grads]


def _assert_same(got, ref, what):
    """Every result finite and bitwise ``ref``'s (``what``: the run, for the messages)."""
    for i, (a, r) in enumerate(zip(got, ref)):
        assert torch.isfinite(a).all(), f"result {i}: not finite {what}"
        assert torch.equal(a, r), f"result {i}: {what} differs from one launch"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}-D{c[3]}-{c[4]}".replace(
    "torch.", "") + ("-varlen" if c[5] else ""))
def test_segmented_passes_equal_one_launch(case, monkeypatch):
    x, cu, cot = _inputs(case)
    monkeypatch.setenv(SEGMENT_ENV, "1")
    ref = _run(x, cu, cot)
    for segments in ("2", "5"):
        monkeypatch.setenv(SEGMENT_ENV, segments)
        _assert_same(_run(x, cu, cot), ref, f"with {segments} segments")
    # on a stream of the caller's (the side streams start after its queued work, and it
    # waits for theirs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = _run(x, cu, cot)
    torch.cuda.current_stream().wait_stream(stream)
    for i, (a, r) in enumerate(zip(got, ref)):
        assert torch.equal(a, r), f"result {i}: differs on the caller's side stream"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}-D{c[3]}-{c[4]}".replace(
    "torch.", "") + ("-varlen" if c[5] else ""))
def test_overlapped_passes_equal_one_launch(case, monkeypatch):
    """Both passes overlapped (chain and group kernel at once, per-group flags), then with the
    fallback path (no stream wait, no naps: group blocks placed before the chain's put their
    tickets back for the cleanup launch), against one launch per kernel (TTT_CUPY_SEGMENTS=1
    turns the overlap off): bitwise."""
    x, cu, cot = _inputs(case)
    monkeypatch.delenv(SPINS_ENV, raising=False)
    monkeypatch.setenv(SEGMENT_ENV, "1")
    ref = _run(x, cu, cot)
    monkeypatch.delenv(SEGMENT_ENV)
    monkeypatch.setenv(OVERLAP_ENV, "1")
    for spins in ("", "0"):
        monkeypatch.setenv(SPINS_ENV, spins)
        _assert_same(_run(x, cu, cot), ref, f"overlapped ({spins!r})")
