"""The TTT-MLP kernels beyond the shared suite: the backward's recompute across checkpoint
groups (a small ``CHECKPOINT_EVERY`` puts group boundaries, and a partial last group, into
short sequences), the launches per call (one forward, one backward) and the generation
step's kernel and eager path. Against the
float64 reference backend. Runs on CUDA when there is a GPU, else in the Triton interpreter
(float32)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

import ttt  # noqa: E402
from ttt.mlp import STATE_NAMES  # noqa: E402
from ttt.testing.calls import ThroughTheDispatcher  # noqa: E402
from ttt.testing.compare import expect_close  # noqa: E402
from ttt.tolerances import TOLERANCES  # noqa: E402
from ttt_triton.ops.ttt_mlp import launcher  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

F32, F64 = torch.float32, torch.float64


def _inputs(seq_lens, H=2, D=16, F=48, seed=0) -> dict:
    """Random inputs of a packed batch of ``seq_lens`` with a random state and eta_key."""
    g = torch.Generator().manual_seed(seed)
    T, N = sum(seq_lens), len(seq_lens)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, dtype=F64)

    return dict(q=randn(1, T, H, D), k=randn(1, T, H, D), v=randn(1, T, H, D),
                w=1 + randn(H, D, scale=0.1), b=randn(H, D, scale=0.1),
                eta=0.1 * torch.rand(1, T, H, 1, generator=g, dtype=F64),
                eta_key=0.5 + torch.rand(1, T, H, 1, generator=g, dtype=F64),
                initial_state=(randn(N, H, D, F, scale=D ** -0.5), randn(N, H, 1, F, scale=0.1),
                               randn(N, H, F, D, scale=F ** -0.5), randn(N, H, 1, D, scale=0.1)),
                cu_seqlens=torch.tensor([0, *seq_lens]).cumsum(0), output_final_state=True)


def _outputs_and_grads(inputs: dict, dtype, backend: str):
    leaves = {n: t.to(dtype).to(DEVICE).requires_grad_() for n, t in inputs.items()
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    state_dtype = F64 if dtype == F64 else F32
    state = tuple(t.to(state_dtype).to(DEVICE).requires_grad_()
                  for t in inputs["initial_state"])
    o, final = ttt.chunk_ttt_mlp(**leaves, initial_state=state,
                                 cu_seqlens=inputs["cu_seqlens"].to(DEVICE),
                                 output_final_state=True, backend=backend)
    g = torch.Generator().manual_seed(1)
    outs = [o, *final]
    cots = [torch.randn(x.shape, generator=g, dtype=F64).to(x) for x in outs]
    names = [*leaves, "W1", "b1", "W2", "b2"]
    grads = torch.autograd.grad(outs, [*leaves.values(), *state], cots)
    return dict(zip(["o", "fW1", "fb1", "fW2", "fb2"], outs)), dict(zip(names, grads))


def test_backward_across_checkpoint_groups(monkeypatch):
    """Sequences of 1, 2, 3 and 7 chunks with a checkpoint every 2 chunks: outputs, final
    state and every gradient as the float64 reference's."""
    monkeypatch.setattr(launcher, "CHECKPOINT_EVERY", 2)
    inputs = _inputs((16, 37, 40, 100))
    out_tol, grad_tol = TOLERANCES[F32]
    got, got_grads = _outputs_and_grads(inputs, F32, "triton")
    want, want_grads = _outputs_and_grads(inputs, F64, "reference")
    for name in got:
        expect_close(name, got[name].double().cpu(), want[name].cpu(), out_tol)
    for name in got_grads:
        expect_close(f"d{name}", got_grads[name].double().cpu(), want_grads[name].cpu(),
                     grad_tol)


def _recorded_launches(monkeypatch) -> list[str]:
    """The names of the kernels the TTT-MLP launcher launches from now on, in order."""
    seen = []
    run = launcher.run_launch
    monkeypatch.setattr(launcher, "run_launch", lambda launch: (seen.append(
        launch.kernel.__name__), run(launch)))
    return seen


def _float32_on_device(inputs: dict) -> dict:
    """``inputs`` (:func:`_inputs`) in float32 on the test device."""
    cast = {n: (t.float().to(DEVICE) if isinstance(t, torch.Tensor) and t.is_floating_point()
                else t) for n, t in inputs.items()}
    cast["initial_state"] = tuple(t.float().to(DEVICE) for t in inputs["initial_state"])
    cast["cu_seqlens"] = inputs["cu_seqlens"].to(DEVICE)
    return cast


def test_one_launch_per_pass(monkeypatch):
    """Inference is one forward launch; training adds one backward launch."""
    seen = _recorded_launches(monkeypatch)
    inputs = _inputs((20, 13))
    with torch.no_grad():
        ttt.chunk_ttt_mlp(**_float32_on_device(inputs), backend="triton")
    assert seen == ["ttt_mlp_fwd_chain_kernel"]
    seen.clear()
    _outputs_and_grads(inputs, F32, "triton")
    assert seen == ["ttt_mlp_fwd_chain_kernel", "ttt_mlp_bwd_chain_kernel"]


def test_generation_step(monkeypatch):
    """A step of at most one token per sequence without autograd is one launch of the step
    kernel; the eager call (the op's implementation run directly) equals the custom op's
    bitwise; with autograd the step runs the chain and its backward."""
    seen = _recorded_launches(monkeypatch)
    monkeypatch.setattr(launcher, "step_splits", lambda *args: 1)   # (as where chains fill
                                                                    # the GPU)
    inputs = _inputs((1, 0, 1), seed=2)
    cast = _float32_on_device(inputs)
    with torch.no_grad():
        o, final = ttt.chunk_ttt_mlp(**cast, backend="triton")
        with ThroughTheDispatcher():
            o_op, final_op = ttt.chunk_ttt_mlp(**cast, backend="triton")
    assert seen == ["ttt_mlp_fwd_decode_kernel"] * 2
    for got, want in zip((o, *final), (o_op, *final_op)):
        assert torch.equal(got, want)
    ref_o, ref_final = ttt.chunk_ttt_mlp(**inputs, backend="reference")
    expect_close("o", o.cpu(), ref_o, TOLERANCES[F32][0])
    for name, got, want in zip(STATE_NAMES, final, ref_final):
        expect_close(f"final {name}", got.cpu(), want, TOLERANCES[F32][0])
    seen.clear()
    _outputs_and_grads(inputs, F32, "triton")
    assert seen == ["ttt_mlp_fwd_chain_kernel", "ttt_mlp_bwd_chain_kernel"]
    seen.clear()
    with torch.no_grad():      # past launcher.STEP_MAX_BD (padded to 128): the chain
        ttt.chunk_ttt_mlp(**_float32_on_device(_inputs((1, 1), D=72, F=16)), backend="triton")
    assert seen == ["ttt_mlp_fwd_chain_kernel"]


SPLIT_STEP = ["ttt_mlp_step_z2_kernel", "ttt_mlp_step_update_kernel",
              "ttt_mlp_step_out_kernel"]


@pytest.mark.parametrize(("D", "F", "splits"), [(64, 200, 3), (64, 200, 4), (64, 200, 8),
                                                (72, 80, 3)])
@pytest.mark.parametrize("given_state", [True, False])
def test_split_generation_step(monkeypatch, D, F, splits, given_state):
    """A generation step with its hidden blocks split over programs (in a CUDA graph
    capture, fewer chains than SMs: ``launcher.step_splits``) is three launches and gives the
    output and final state of the step in one launch (past ``STEP_MAX_BD``, the chain's): a
    packed batch with an empty sequence, eta_key, hidden width 200 in blocks of 64 (3
    splits: two of two blocks; 4 and 8: four, the last partial) and, at head dim 72 (padded
    to 128), 80 in blocks of 32; with and without an initial state."""
    seen = _recorded_launches(monkeypatch)
    cast = _float32_on_device(_inputs((1, 0, 1), D=D, F=F, seed=4))
    if not given_state:
        del cast["initial_state"]
    with torch.no_grad():
        monkeypatch.setattr(launcher, "step_splits", lambda *args: 1)
        one = ttt.chunk_ttt_mlp(**cast, backend="triton")
        monkeypatch.setattr(launcher, "step_splits", lambda *args: splits)
        monkeypatch.setattr(launcher, "capturing", lambda: True)
        monkeypatch.setattr(launcher, "split_loaded", lambda key: True)
        split = ttt.chunk_ttt_mlp(**cast, backend="triton")
    whole = "ttt_mlp_fwd_decode_kernel" if D <= 64 else "ttt_mlp_fwd_chain_kernel"
    assert seen == [whole, *SPLIT_STEP]
    for name, got, want in zip(("o", *STATE_NAMES), (split[0], *split[1]),
                               (one[0], *one[1])):
        expect_close(name, got.double().cpu(), want.double().cpu(), TOLERANCES[F32][0])
    assert not torch.equal(one[0], torch.zeros_like(one[0]))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_split_step_in_a_cuda_graph(monkeypatch):
    """An eager step, then the same step captured in a CUDA graph: the capture takes the
    split launches (four chains, fewer than the SMs), loaded by the eager call, and the
    replay gives the eager step's output and final state."""
    seen = _recorded_launches(monkeypatch)
    cast = _float32_on_device(_inputs((1, 1), D=64, F=256, seed=5))
    del cast["cu_seqlens"]                      # dense: two sequences of one token
    for name in ("q", "k", "v", "eta", "eta_key"):
        cast[name] = cast[name].reshape(2, 1, *cast[name].shape[2:])
    with torch.no_grad():
        want = ttt.chunk_ttt_mlp(**cast, backend="triton")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = ttt.chunk_ttt_mlp(**cast, backend="triton")
        graph.replay()
        torch.cuda.synchronize()
    assert seen == ["ttt_mlp_fwd_decode_kernel", *SPLIT_STEP]
    for name, g, w in zip(("o", *STATE_NAMES), (got[0], *got[1]), (want[0], *want[1])):
        expect_close(name, g.double().cpu(), w.double().cpu(), TOLERANCES[F32][0])


def test_step_splits():
    """In a CUDA graph: one launch where the chains fill the SMs (or off a GPU); fewer
    chains split the hidden blocks toward two programs an SM, one block or more each."""
    assert launcher.step_splits(64, 4, None) == 1
    assert launcher.step_splits(132, 4, 132) == 1 and launcher.step_splits(1024, 4, 132) == 1
    assert launcher.step_splits(64, 4, 132) == 4 and launcher.step_splits(16, 4, 132) == 4
    assert launcher.step_splits(100, 4, 132) == 3 and launcher.step_splits(64, 2, 132) == 2


def test_backward_beyond_the_largest_tile_is_refused():
    """Training at chunk 64 and a padded head dim of 128 needs more shared memory than a
    GPU block has: the backend refuses it with the reason (the automatic choice then takes
    another backend); the forward alone, and training at chunk 32, are taken."""
    from ttt.errors import BackendNotSupportedError
    from ttt.mlp import make_mlp_problem

    backend = ttt.registry.load_backend("triton")

    def problem(D, chunk, grad):
        x = torch.randn(1, chunk, 2, D, device=DEVICE, requires_grad=grad)
        w = torch.ones(2, D, device=DEVICE)
        eta = torch.full((1, chunk, 2, 1), 0.1, device=DEVICE)
        return make_mlp_problem(x, x, x, w, w, eta, chunk_size=chunk), x

    assert not launcher.backward_fits(128, 64) and not launcher.backward_fits(65, 64)
    assert launcher.backward_fits(64, 64) and launcher.backward_fits(128, 32)
    assert launcher.backward_fits(8, 64)                # padded to 16
    refused, x = problem(100, 64, grad=True)
    reasons = backend.not_supported_reasons(refused)
    assert any("ttt_mlp backward at head dim 100 with chunk_size 64" in r for r in reasons)
    with pytest.raises(BackendNotSupportedError, match="more shared memory"):
        ttt.chunk_ttt_mlp(x, x, x, torch.ones(2, 100, device=DEVICE),
                          torch.zeros(2, 100, device=DEVICE), 0.1, chunk_size=64,
                          backend="triton")
    for D, chunk, grad in ((100, 64, False), (128, 32, True), (64, 64, True)):
        assert not any("ttt_mlp backward" in r
                       for r in backend.not_supported_reasons(problem(D, chunk, grad)[0]))
