"""On a GPU: every schedule of the launcher (ttt_cupy.placement, forced with a
``Schedule``): the segmented and overlapped passes (also the overlapped fallback path,
``overlap_spins=0``) give bitwise the outputs, final states and gradients of one launch per
kernel, also on a stream of the caller's; and every schedule, the fused chains included,
matches the float64 reference within the suite's tolerances; fwd_decode (a short generation
step's kernel) against the reference and the fused chain. Dense and varlen batches, every
dtype. Skips without a CUDA GPU and cupy; on CPU the same launches run through the emulation
(test_cpu_launcher.py, test_cpu_emulation.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ttt
from ttt import make_problem
from ttt.tolerances import TOLERANCES

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
    reason="needs a CUDA GPU and cupy")

CASES = [
    # B, T, H, D, dtype, varlen lengths (None: dense)
    (2, 1000, 3, 64, torch.bfloat16, None),     # 63 chunks: 4 groups
    (1, 4096, 2, 128, torch.float32, None),     # SIMT fp32, 16 groups
    (3, 700, 2, 50, torch.float16, None),       # a padded head dim
    (1, 2030, 2, 64, torch.bfloat16, [1300, 700, 30]),  # varlen: groups 6, 3 and 1
]
IDS = [f"T{c[1]}-D{c[3]}-{str(c[4]).removeprefix('torch.')}" + ("-varlen" if c[5] else "")
       for c in CASES]


def _inputs(case, key=False):
    B, T, H, D, dtype, lens = case
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    N = B if lens is None else len(lens)
    x = dict(q=randn(B, T, H, D), k=torch.nn.functional.normalize(randn(B, T, H, D), dim=-1),
             v=randn(B, T, H, D), w=1 + 0.1 * randn(H, D), b=0.1 * randn(H, D),
             eta=0.1 * torch.rand(B, T, H, 1, generator=gen, device="cuda"))
    x = {n: a.to(dtype) for n, a in x.items()}
    x["initial_state"] = 0.1 * randn(N, H, D, D)
    x["initial_state_bias"] = 0.1 * randn(N, H, 1, D)
    cu = None
    if lens is not None:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    cot = (randn(B, T, H, D).to(dtype), randn(N, H, D, D), randn(N, H, 1, D))
    if key:   # (drawn last: the other inputs stay those without it)
        x["eta_key"] = (0.3 + 1.4 * torch.rand(B, T, H, 1, generator=gen, device="cuda")).to(
            dtype)
    return x, cu, cot


def _run(x, cu, cot, schedule, output="norm_residual", needs=None):
    """The launcher's outputs, final states and every gradient under ``schedule`` (deta_key
    last, with eta_key; ``needs``: GradNeeds, the gradients not asked for are None)."""
    from ttt_cupy import launcher

    p = make_problem(**x, output_final_state=True, cu_seqlens=cu, output=output)
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, True, schedule=schedule)
    got = launcher.ttt_linear_bwd(p, saved, *cot, schedule=schedule, needs=needs)
    grads = [got.dq, got.dk, got.dv, got.dw, got.db, got.deta, got.dh0, got.dhb0, got.deta_key]
    if needs is None and "eta_key" not in x:
        grads = grads[:-1]
    return [o, ht, hbt, *grads]


def _assert_same(got, ref, what):
    for i, (a, r) in enumerate(zip(got, ref)):
        assert torch.isfinite(a).all(), f"result {i}: not finite {what}"
        assert torch.equal(a, r), f"result {i}: {what} differs from one launch"


def _plain():
    from ttt_cupy.config import Schedule

    return Schedule(overlap=False, segments=1)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_segmented_passes_equal_one_launch(case):
    from ttt_cupy.config import Schedule

    x, cu, cot = _inputs(case)
    ref = _run(x, cu, cot, _plain())
    for segments in (2, 5):
        got = _run(x, cu, cot, Schedule(overlap=False, segments=segments))
        _assert_same(got, ref, f"with {segments} segments")
    # on a stream of the caller's (the side streams start after its queued work, and it
    # waits for theirs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = _run(x, cu, cot, Schedule(overlap=False, segments=3))
    torch.cuda.current_stream().wait_stream(stream)
    _assert_same(got, ref, "on the caller's side stream")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_overlapped_passes_equal_one_launch(case):
    """Both passes overlapped, then with the fallback path (no stream wait, no naps: group
    blocks placed before the chain's hand their tickets to the cleanup launch)."""
    from ttt_cupy.config import Schedule

    x, cu, cot = _inputs(case)
    ref = _run(x, cu, cot, _plain())
    for spins in (Schedule().overlap_spins, 0):
        got = _run(x, cu, cot, Schedule(overlap=True, overlap_spins=spins))
        _assert_same(got, ref, f"overlapped ({spins} spins)")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_schedule_matches_reference(case):
    """Outputs, final states and every gradient of each schedule against the float64
    reference (the fused backward chain exists for half inputs at D_PAD <= 64 only)."""
    from ttt_cupy.config import AUTO, Schedule

    x, cu, cot = _inputs(case)
    ref_in = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, rht, rhbt = ttt.chunk_ttt_linear(**ref_in, output_final_state=True, cu_seqlens=cu,
                                         backend="reference")
    grads = torch.autograd.grad((ro, rht, rhbt), list(ref_in.values()),
                                tuple(c.double() for c in cot))
    ref = [ro, rht, rhbt, *grads]
    out_tol, grad_tol = TOLERANCES[case[4]]
    schedules = {"rule": AUTO, "plain": _plain(), "segments": Schedule(overlap=False, segments=3),
                 "overlapped": Schedule(overlap=True),
                 "fused": Schedule(fuse_forward=True, fuse_backward=True)}
    for what, schedule in schedules.items():
        got = _run(x, cu, cot, schedule)
        for i, (a, r) in enumerate(zip(got, ref)):
            err = float((a.double() - r.detach()).norm() / r.detach().norm())
            tol = out_tol if i < 3 else grad_tol
            assert err < tol, f"{what}: result {i} relative error {err:.2e} (bound {tol})"


VARIANTS = [(True, "norm_residual"), (True, "query_residual"), (True, "raw"),
            (False, "query_residual"), (False, "raw")]


@pytest.mark.parametrize("variant", VARIANTS,
                         ids=[("key-" if v[0] else "") + v[1] for v in VARIANTS])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_variants_every_schedule(case, variant):
    """eta_key and the output forms: every schedule against the float64 reference (deta_key
    included), the segmented and overlapped passes bitwise the plain one's, and a backward
    asked for dq and deta_key only bitwise the full one's (the unfused chain alone)."""
    from ttt import GradNeeds
    from ttt_cupy.config import AUTO, Schedule

    key, output = variant
    x, cu, cot = _inputs(case, key)
    ref_in = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, rht, rhbt = ttt.chunk_ttt_linear(**ref_in, output_final_state=True, cu_seqlens=cu,
                                         output=output, backend="reference")
    grads = torch.autograd.grad((ro, rht, rhbt), list(ref_in.values()),
                                tuple(c.double() for c in cot))
    ref = [ro, rht, rhbt, *grads]
    out_tol, grad_tol = TOLERANCES[case[4]]
    plain = _run(x, cu, cot, _plain(), output)
    schedules = {"rule": AUTO, "segments": Schedule(overlap=False, segments=3),
                 "overlapped": Schedule(overlap=True),
                 "fused": Schedule(fuse_forward=True, fuse_backward=True)}
    for what, schedule in {"plain": None, **schedules}.items():
        got = plain if schedule is None else _run(x, cu, cot, schedule, output)
        assert len(got) == len(ref)
        for i, (a, r) in enumerate(zip(got, ref)):
            err = float((a.double() - r.detach()).norm() / r.detach().norm())
            tol = out_tol if i < 3 else grad_tol
            assert err < tol, f"{what}: result {i} relative error {err:.2e} (bound {tol})"
        if what in ("segments", "overlapped"):
            _assert_same(got, plain, what)
    needs = GradNeeds(k=False, v=False, w=False, b=False, eta=False, initial_state=False,
                      initial_state_bias=False, eta_key=key)
    fused = Schedule(fuse_forward=True, fuse_backward=True)
    full = _run(x, cu, cot, fused, output)
    few = _run(x, cu, cot, fused, output, needs)
    _assert_same([few[3]], [full[3]], "dq of a backward asked for few gradients")
    if key:
        _assert_same([few[-1]], [full[-1]], "deta_key of a backward asked for few gradients")
    assert all(t is None for t in few[4:-1]), "gradients computed though not needed"


DECODE_CASES = [
    # dtype, D, sequence lengths (dense: all equal), eta_key, output form
    (torch.float32, 64, (1,) * 8, True, "query_residual"),
    (torch.float32, 64, (4,) * 3, False, "norm_residual"),
    (torch.float32, 24, (1, 0, 3, 4, 1), True, "raw"),
    (torch.float32, 100, (16,) * 2, True, "query_residual"),
    (torch.bfloat16, 64, (1,) * 8, True, "query_residual"),
    (torch.float16, 128, (1, 1, 0, 1), False, "norm_residual"),
    (torch.bfloat16, 64, (3,) * 2, True, "raw"),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[
    f"{str(c[0]).removeprefix('torch.')}-D{c[1]}-{'+'.join(map(str, c[2]))}-"
    f"{'key-' if c[3] else ''}{c[4]}" for c in DECODE_CASES])
def test_decode_kernel_matches_reference(case):
    """fwd_decode (placement.row_step: every case within ROW_STEP_ROWS rows) against the
    float64 reference and against the fused chain (Schedule.fuse_forward=True), outputs and
    final states, dense and packed (an empty sequence passes its states through)."""
    from ttt_cupy import launcher, placement
    from ttt_cupy.config import AUTO, Schedule

    dtype, D, lens, key, output = case
    gen = torch.Generator(device="cuda").manual_seed(0)
    dense = len(set(lens)) == 1
    B, T, N, H = (len(lens), lens[0], len(lens), 2) if dense else (1, sum(lens), len(lens), 2)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen, device="cuda")

    x = dict(q=randn(B, T, H, D), k=torch.nn.functional.normalize(randn(B, T, H, D), dim=-1),
             v=randn(B, T, H, D), w=1 + randn(H, D, scale=0.1), b=randn(H, D, scale=0.1),
             eta=0.1 * torch.rand(B, T, H, 1, generator=gen, device="cuda"))
    x = {n: a.to(dtype) for n, a in x.items()}
    x["initial_state"] = randn(N, H, D, D, scale=0.1)
    x["initial_state_bias"] = randn(N, H, 1, D, scale=0.1)
    if key:
        x["eta_key"] = (0.3 + 1.4 * torch.rand(B, T, H, 1, generator=gen, device="cuda")).to(
            dtype)
    cu = None if dense else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                         device="cuda")
    p = make_problem(**x, output_final_state=True, cu_seqlens=cu, output=output)
    assert placement.row_step(p, False, 227 * 1024)
    got = launcher.ttt_linear_fwd(p, False, schedule=AUTO)[:3]
    chain = launcher.ttt_linear_fwd(p, False, schedule=Schedule(fuse_forward=True))[:3]
    ref = ttt.chunk_ttt_linear(**{n: t.double() for n, t in x.items()},
                               output_final_state=True, cu_seqlens=cu, output=output,
                               backend="reference")
    out_tol, _ = TOLERANCES[dtype]
    for i, (a, c, r) in enumerate(zip(got, chain, ref)):
        for what, b in (("reference", r), ("fused chain", c.double())):
            err = float((a.double() - b).norm() / b.norm())
            assert err < out_tol, f"result {i}: relative error {err:.2e} to the {what}"
    for n, length in enumerate(() if dense else lens):
        if length == 0:
            assert torch.equal(got[1][n], x["initial_state"][n])
            assert torch.equal(got[2][n], x["initial_state_bias"][n])
