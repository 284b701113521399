"""Generation steps (every sequence within one chunk, no gradient): one kernel launch,
whatever the chain count, and no other device work in the launcher: fwd_decode when every
sequence is short enough (``tuning.row_step``), else the fused forward chain
(``ttt.schedule.generation_step``). Results against the float64 oracle. Runs on CUDA when
there is a GPU, else in the Triton interpreter (float32)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from launcher_cases import LaunchSpy  # noqa: E402

import ttt  # noqa: E402
from ttt.oracle import oracle_chunk_ttt_linear  # noqa: E402
from ttt.schedule import generation_step  # noqa: E402
from ttt.tolerances import TOLERANCES  # noqa: E402
from ttt_triton.ops.ttt_linear import launcher  # noqa: E402
from ttt_triton.ops.ttt_linear.tuning import (  # noqa: E402
    DEFAULT_TUNING,
    ROW_STEP_ROWS,
    Tuning,
    fused_forward,
    row_step,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

F64 = torch.float64
KERNELS = ("ttt_linear_fwd_decode_kernel", "ttt_linear_fwd_chain_kernel",
           "ttt_linear_fwd_out_kernel", "ttt_linear_bwd_local_kernel",
           "ttt_linear_bwd_chain_kernel", "ttt_linear_bwd_grads_kernel")


def _spy(monkeypatch, run=True) -> list:
    launches = []
    for name in KERNELS:
        monkeypatch.setattr(launcher, name, LaunchSpy(getattr(launcher, name), launches, run))
    return launches


def _inputs(B, seq_lens, H, D, chunk, seed, *, eta_tensor, eta_key, states, final, output):
    """Fresh random float64 inputs (never zeros) of a dense batch (``seq_lens`` None: B
    sequences of one token) or a packed one; ``states`` True (both initial states), False,
    "state" or "bias" (that one alone)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(seq_lens) if seq_lens else 1
    B = 1 if seq_lens else B
    N = len(seq_lens) if seq_lens else B

    def rand(*shape, scale=1.0, offset=0.0, uniform=False):
        x = (torch.rand if uniform else torch.randn)(*shape, generator=g, dtype=F64)
        return offset + scale * x

    k = rand(B, T, H, D)
    x = dict(q=rand(B, T, H, D), k=k / k.norm(dim=-1, keepdim=True), v=rand(B, T, H, D),
             w=rand(H, D, scale=0.1, offset=1.0), b=rand(H, D, scale=0.1),
             eta=rand(B, T, H, 1, scale=0.1, uniform=True) if eta_tensor else 0.05,
             chunk_size=chunk, output_final_state=final, output=output)
    if eta_key:
        x["eta_key"] = rand(B, T, H, 1, offset=0.5, uniform=True)
    if states in (True, "state"):
        x["initial_state"] = rand(N, H, D, D, scale=0.1)
    if states in (True, "bias"):
        x["initial_state_bias"] = rand(N, H, 1, D, scale=0.1)
    if seq_lens:
        x["cu_seqlens"] = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    return x


def _on_device(x: dict, dtype=torch.float32) -> dict:
    def cast(name, t):
        if not isinstance(t, torch.Tensor):
            return t
        if name == "cu_seqlens":
            return t.to(DEVICE)
        return t.to(DEVICE, torch.float32 if name.startswith("initial") else dtype)
    return {n: cast(n, t) for n, t in x.items()}


DECODE_CASES = [
    # (B, seq_lens, eta_tensor, eta_key, states, final, output)
    (1, None, True, False, True, True, "norm_residual"),
    (4, None, False, True, True, True, "query_residual"),
    (1, (1, 0, 1, 1), True, True, True, True, "query_residual"),
    (1, (0, 1), False, False, True, True, "norm_residual"),
    (4, None, True, True, False, False, "raw"),
    (3, None, False, False, False, True, "norm_residual"),
    (1, (1, 1, 1), True, True, True, True, "query_residual"),
    (1, (1, 5, 16, 2), False, False, True, True, "raw"),
    (1, (3, 1), True, False, False, True, "norm_residual"),
    (1, (4, 2, 3), False, True, True, True, "query_residual"),
    (2, None, True, True, "state", True, "query_residual"),
    (1, (2, 1), True, False, "bias", True, "norm_residual"),
]


@pytest.mark.parametrize("B,seq_lens,eta_tensor,eta_key,states,final,output", DECODE_CASES)
def test_decode_step_is_one_launch(monkeypatch, B, seq_lens, eta_tensor, eta_key, states,
                                   final, output):
    """A generation step through the public op launches one kernel, once: fwd_decode when
    every sequence is short enough for it (float32: ``ROW_STEP_ROWS["fp32"]``; a packed
    sequence may be empty), else fwd_chain; and matches the float64 oracle. The head dim
    (24) is not a power of two: the tiles are masked."""
    H, D, chunk = 2, 24, 16
    x = _inputs(B, seq_lens, H, D, chunk, 5, eta_tensor=eta_tensor, eta_key=eta_key,
                states=states, final=final, output=output)
    launches = _spy(monkeypatch)
    with torch.no_grad():
        o, ht, hbt = ttt.chunk_ttt_linear(**_on_device(x), backend="triton")
    rows = max(seq_lens or (1,))
    expected = ("ttt_linear_fwd_decode_kernel" if rows <= ROW_STEP_ROWS["fp32"]
                else "ttt_linear_fwd_chain_kernel")
    assert [kernel.fn.__name__ for kernel, _ in launches] == [expected]
    N = sum(length > 0 for length in seq_lens) if seq_lens else B   # (the op drops empty ones)
    assert launches[0][1] == (N * H,)
    _check_against_oracle(x, final, (o, ht, hbt))


def _check_against_oracle(x: dict, final: bool, results) -> None:
    want = oracle_chunk_ttt_linear(**{n: t for n, t in x.items() if n != "output_final_state"})
    tol = TOLERANCES[torch.float32][0]
    for got, ref in zip(results, want):
        if not final and got is not results[0]:
            assert got is None
            continue
        err = ((got.to("cpu", F64) - ref).norm() / ref.norm()).item()
        assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def test_decode_kernel_passes_an_empty_sequence_through():
    """fwd_decode called by the launcher on a packed batch with an empty sequence (the public
    op drops those before the backend): its state comes out as it went in, the others'
    match the oracle."""
    x = _inputs(1, (1, 0, 1), 2, 24, 16, 9, eta_tensor=True, eta_key=True, states=True,
                final=True, output="norm_residual")
    with torch.no_grad():
        problem = ttt.make_problem(**_on_device(x))
        assert row_step(problem, False, DEFAULT_TUNING)
        o, ht, hbt, _ = launcher.ttt_linear_fwd(problem, save_for_backward=False)
    assert torch.equal(ht[1].cpu(), x["initial_state"][1].float())
    assert torch.equal(hbt[1].cpu(), x["initial_state_bias"][1].float())
    _check_against_oracle(x, True, (o, ht, hbt))


FORMS_IN_TURN = [  # eta_tensor, eta_key, states, final, output: each differs in one from the first
    (True, False, False, True, "norm_residual"),
    (True, False, True, True, "norm_residual"),
    (True, False, "state", True, "norm_residual"),
    (True, False, "bias", True, "norm_residual"),
    (True, False, False, True, "query_residual"),
    (True, False, False, True, "raw"),
    (True, True, False, True, "norm_residual"),
    (True, False, False, False, "norm_residual"),
    (False, False, False, True, "norm_residual"),
]


def test_decode_steps_of_every_form_in_turn():
    """Generation steps of one batch shape, each form after another and twice over with new
    values: the launcher keeps what each configuration's launches take besides its tensors
    (``launcher._forward_setup``), and every step still matches the oracle (nothing kept for
    one configuration, or from an earlier step, reaches another step's launch)."""
    B, H, D, chunk = 3, 2, 32, 16
    for seed in (11, 12):
        for eta_tensor, eta_key, states, final, output in FORMS_IN_TURN:
            x = _inputs(B, None, H, D, chunk, seed, eta_tensor=eta_tensor, eta_key=eta_key,
                        states=states, final=final, output=output)
            with torch.no_grad():
                results = ttt.chunk_ttt_linear(**_on_device(x), backend="triton")
            _check_against_oracle(x, final, results)


def test_launcher_does_no_other_device_work(monkeypatch):
    """Around the one launch of a generation step (dense or packed, with both initial
    states, one or none, with final states) the launcher only allocates: no fill, copy or
    cast (fp32 states are passed as they are, a missing one is zeros in the kernel, the
    packed grouping's maps are not copied)."""
    launches = _spy(monkeypatch, run=False)
    allowed = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
               torch.ops.aten.empty_strided.default}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    for B, seq_lens, states in ((4, None, True), (2, None, False), (3, None, "bias"),
                                (1, (1, 3, 1), True), (1, (2, 1), False),
                                (1, (2, 1), "state")):
        x = _inputs(B, seq_lens, 2, 32, 16, 7, eta_tensor=True, eta_key=True,
                    states=states, final=True, output="query_residual")
        x.pop("output")
        with torch.no_grad():
            problem = ttt.make_problem(**_on_device(x), output="query_residual")
        assert generation_step(problem, False) and fused_forward(problem, False, DEFAULT_TUNING)
        launches.clear()
        with Ops() as ops:
            launcher.ttt_linear_fwd(problem, save_for_backward=False)
        assert len(launches) == 1
        assert set(ops.seen) <= allowed, f"device work besides allocation: {ops.seen}"


def test_training_and_long_calls_keep_their_rule():
    """Only a forward without backward whose sequences all fit one chunk is a generation
    step; a backward, or one longer sequence, keeps the chain-count rule."""
    def problem(seq_lens, chunk=16):
        x = _inputs(1, seq_lens, 2, 16, chunk, 3, eta_tensor=True, eta_key=False,
                    states=False, final=False, output="norm_residual")
        return ttt.make_problem(**_on_device(x))

    assert generation_step(problem((1, 16)), False)
    assert not generation_step(problem((1, 16)), True)
    assert not generation_step(problem((1, 17)), False)
    assert generation_step(problem((1, 17), chunk=32), False)
    assert not fused_forward(problem((1, 17)), False, DEFAULT_TUNING)   # 4 chains < 96


def test_row_steps_by_dtype_and_head_dim():
    """fwd_decode takes the generation steps of at most ``ROW_STEP_ROWS`` rows per sequence
    for the dtype and head dim, unless the chained kernels are forced; never a training call."""
    def problem(T, D, dtype):
        x = _inputs(2, None, 2, D, 16, 4, eta_tensor=True, eta_key=True, states=True,
                    final=True, output="query_residual")
        x = {n: (t.expand(2, T, *t.shape[2:]) if n in ("q", "k", "v", "eta", "eta_key")
                 else t) for n, t in x.items()}
        return ttt.make_problem(**_on_device(x, dtype))

    for dtype, D, rows in ((torch.bfloat16, 64, ROW_STEP_ROWS["half"]),
                           (torch.float16, 128, ROW_STEP_ROWS["half"]),
                           (torch.float32, 64, ROW_STEP_ROWS["fp32"]),
                           (torch.float32, 100, ROW_STEP_ROWS["fp32_wide"])):
        assert row_step(problem(rows, D, dtype), False, DEFAULT_TUNING)
        assert not row_step(problem(rows, D, dtype), True, DEFAULT_TUNING)
        assert not row_step(problem(rows, D, dtype), False, Tuning(fuse_forward=True))
        if rows < 16:
            assert not row_step(problem(rows + 1, D, dtype), False, DEFAULT_TUNING)
