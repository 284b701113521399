"""No GPU needed: the cupy launcher end to end, its launches run by the CPU emulation.

tests/test_cpu_emulation.py drives the emulated kernels (conftest.emu) with arguments it builds
itself. Here the launcher's own launches go to them: every argument the launcher builds (its
buffers and their addresses, the segment and overlap plans, the launch order) reaches the
kernels' C++, and its outputs, final states and every gradient are checked against the
reference backend in float64. float32 inputs only (their SIMT instances: the emulation's half
is a 4-byte stand-in, the launcher's half tensors are 2 bytes), with eta, w and b in other
dtypes too (the launcher turns them into float32). Streams, events and stream waits are
stand-ins, so the launches run one after the other in the host's order, which every pass
keeps consistent with its streams (a segment's chain before its group kernels; an overlapped
pass's chain before its group kernel, whose blocks then find every group finished).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ttt
from ttt import GradNeeds, make_problem
from ttt.arguments import GRAD_INPUTS
from ttt_cupy import launcher
from ttt_cupy.config import AUTO, Schedule


def _inputs(D, lens, H, param_dtype, init, seed=0, key=False):
    gen = torch.Generator().manual_seed(seed)
    N, T = len(lens), sum(lens)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    k = randn(1, T, H, D)
    x = dict(q=randn(1, T, H, D), k=k / k.norm(dim=-1, keepdim=True), v=randn(1, T, H, D),
             w=(1 + randn(H, D, scale=0.1)).to(param_dtype), b=randn(H, D, scale=0.1).to(
                 param_dtype),
             eta=(0.1 * torch.rand(1, T, H, 1, generator=gen)).to(param_dtype))
    if init:
        x["initial_state"] = randn(N, H, D, D, scale=0.1)
        x["initial_state_bias"] = randn(N, H, 1, D, scale=0.1)
    if key:   # (drawn last: the other inputs stay those without it)
        x["eta_key"] = (0.3 + 1.4 * torch.rand(1, T, H, 1, generator=gen)).to(param_dtype)
    cu = None
    if N > 1:
        cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    return x, cu


CASES = [  # D, sequence lengths, heads, eta / w / b dtype, initial states, schedule
    (64, (300,), 2, torch.float32, True, Schedule(overlap=False)),          # one launch each
    (64, (300,), 2, torch.bfloat16, False, Schedule(overlap=False, segments=2)),  # segments
    (20, (150, 170), 1, torch.float16, True, Schedule(overlap=True)),       # overlapped, varlen
    (64, (90,), 2, torch.float64, True, Schedule(fuse_forward=True)),       # fused forward
    (32, (40, 7, 60), 2, torch.bfloat16, False, AUTO),                      # the rule
]


def _id(case):
    D, lens, H, dt, init, schedule = case
    what = ",".join(f"{k}={v}" for k, v in vars(schedule).items()
                    if v != getattr(AUTO, k)) or "rule"
    return f"D{D}-{'+'.join(map(str, lens))}-H{H}-{str(dt).split('.')[1]}-" \
           f"{'h0' if init else 'no-h0'}-{what}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_launcher_end_to_end_matches_reference(emulated, case):
    _check_end_to_end(emulated, *case)


VARIANT_CASES = [  # as CASES, then eta_key given, the output form
    (64, (300,), 2, torch.float32, True, Schedule(overlap=False), True, "query_residual"),
    (64, (300,), 2, torch.bfloat16, False, Schedule(overlap=False, segments=2), True, "raw"),
    (20, (150, 170), 1, torch.float16, True, Schedule(overlap=True), True, "norm_residual"),
    (64, (90,), 2, torch.float64, True, Schedule(fuse_forward=True), True, "raw"),
    (32, (40, 7, 60), 2, torch.bfloat16, False, AUTO, True, "query_residual"),
    (20, (150, 170), 1, torch.float32, True, Schedule(overlap=True), False, "query_residual"),
    (64, (90,), 2, torch.float32, True, Schedule(fuse_forward=True), False, "raw"),
]


def _vid(case):
    return f"{_id(case[:6])}-{'key-' if case[6] else ''}{case[7]}"


@pytest.mark.parametrize("case", VARIANT_CASES, ids=[_vid(c) for c in VARIANT_CASES])
def test_launcher_variants_match_reference(emulated, case):
    """eta_key and the output forms through the launcher (dense and varlen, each schedule):
    outputs, final states and every gradient, deta_key included, against the reference."""
    _check_end_to_end(emulated, *case)


def _kept_setups(device) -> tuple[int, int]:
    """The launcher's kept forward and backward setups for ``device``."""
    return tuple(sum(key[0] is device for key in setups)
                 for setups in (launcher._FORWARD_SETUPS, launcher._BACKWARD_SETUPS))


@pytest.mark.parametrize("case", [CASES[0], CASES[3], VARIANT_CASES[0]],
                         ids=["unfused", "fused", "key-query_residual"])
def test_a_configuration_seen_before_launches_on_the_new_tensors(emulated, case):
    """A dense configuration's second call takes the setup kept by its first (the grouping,
    the plan, the kernels, the scalar arguments); its launches read and write that call's
    own tensors: new inputs, new buffers, all checked against the reference again."""
    _check_end_to_end(emulated, *case)
    kept = _kept_setups(emulated)
    assert kept == (1, 1)
    _check_end_to_end(emulated, *case, seed=1)
    assert _kept_setups(emulated) == kept


def test_packed_batches_keep_no_setup(emulated):
    """A packed batch's grouping holds device tensors of its own: made at every call."""
    _check_end_to_end(emulated, *CASES[4])
    assert _kept_setups(emulated) == (0, 0)


def _problem(x, cu, D, output="norm_residual"):
    return make_problem(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"], scale=D ** -0.5,
                        eps=1e-6, chunk_size=16, initial_state=x.get("initial_state"),
                        initial_state_bias=x.get("initial_state_bias"),
                        output_final_state=True, cu_seqlens=cu, eta_key=x.get("eta_key"),
                        output=output)


def _check_end_to_end(emulated, D, lens, H, param_dtype, init, schedule, key=False,
                      output="norm_residual", seed=0):
    x, cu = _inputs(D, lens, H, param_dtype, init, seed=seed, key=key)
    scale, eps, bt = D ** -0.5, 1e-6, 16
    p = _problem(x, cu, D, output)
    emulated.inputs = [t for t in (*x.values(), cu) if t is not None]
    before = {name: t.clone() for name, t in x.items()}
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, save_for_backward=True, schedule=schedule,
                                                device=emulated)
    gen = torch.Generator().manual_seed(1)
    do, dht, dhbt = (torch.randn(t.shape, generator=gen) for t in (o, ht, hbt))
    grads = launcher.ttt_linear_bwd(p, saved, do, dht, dhbt, schedule=schedule,
                                    device=emulated)
    dq, dk, dv, dw, db, deta, dh0, dhb0, deta_key = (
        grads.dq, grads.dk, grads.dv, grads.dw, grads.db, grads.deta, grads.dh0, grads.dhb0,
        grads.deta_key)
    assert {"emu_fwd_chain", "emu_fwd_chain_fused"} & set(emulated.ran), emulated.ran
    for name, t in x.items():  # inputs are never mutated
        assert torch.equal(t, before[name]), name
    assert (deta_key is None) == (not key)
    results = [o, ht, hbt, dq, dk, dv, dw, db, deta, dh0, dhb0, deta_key]
    _assert_fresh(results, [*x.values(), do, dht, dhbt])

    ref_in = {name: t.detach().double().requires_grad_() for name, t in x.items()}
    ro, rht, rhbt = ttt.chunk_ttt_linear(**ref_in, scale=scale, eps=eps, chunk_size=bt,
                                         output_final_state=True, cu_seqlens=cu,
                                         output=output, backend="reference")
    grads = torch.autograd.grad((ro, rht, rhbt), list(ref_in.values()),
                                (do.double(), dht.double(), dhbt.double()))
    ref = dict(zip(ref_in, grads))
    got = dict(q=dq, k=dk, v=dv, w=dw, b=db, eta=deta, initial_state=dh0,
               initial_state_bias=dhb0, eta_key=deta_key)

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    for what, a, b in (("o", o, ro), ("ht", ht, rht), ("hbt", hbt, rhbt),
                       *((f"d{name}", got[name], ref[name]) for name in ref_in)):
        assert a.shape == b.shape, what
        assert rel(a, b.detach()) < 2e-4, f"{what}: relative error {rel(a, b.detach()):.2e}"


def _assert_fresh(results, inputs):
    """No result is an input or shares storage with an input or another result."""
    given = [t for t in results if t is not None]
    ptrs = [t.untyped_storage().data_ptr() for t in given]
    assert len(set(ptrs)) == len(ptrs), "two results share storage"
    taken = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    assert not taken & set(ptrs), "a result shares storage with an input"


NEEDS = {  # what a caller may ask for (GradNeeds fields set False)
    "frozen-w-b": dict(w=False, b=False),
    "no-initial-state": dict(initial_state=False, initial_state_bias=False),
    "q-only": dict(k=False, v=False, w=False, b=False, eta=False, initial_state=False,
                   initial_state_bias=False, eta_key=False),
    "q-eta": dict(k=False, v=False, w=False, b=False, initial_state=False,
                  initial_state_bias=False),
    "eta-key-only": dict(q=False, k=False, v=False, w=False, b=False, eta=False,
                         initial_state=False, initial_state_bias=False),
    "k-v-only": dict(q=False, w=False, b=False, eta=False, initial_state=False,
                     initial_state_bias=False, eta_key=False),
    "dh0-only": dict(q=False, k=False, v=False, w=False, b=False, eta=False, eta_key=False),
}


@pytest.mark.parametrize("schedule", [Schedule(overlap=False), Schedule(overlap=True),
                                      Schedule(overlap=False, segments=2)],
                         ids=["plain", "overlapped", "segments"])
@pytest.mark.parametrize("what", list(NEEDS))
def test_backward_computes_only_what_is_needed(emulated, what, schedule):
    """``needs`` (GradNeeds) with few gradients: those asked for are bitwise the full
    backward's, the others None (not computed: no bwd_grads launch without dk, dv, dw, db, no
    backward chain for dq alone), every result fresh."""
    D, lens = 20, (150, 170)
    x, cu = _inputs(D, lens, 1, torch.float32, True, key=True)
    p = _problem(x, cu, D, "query_residual")
    emulated.inputs = [t for t in (*x.values(), cu) if t is not None]
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, True, schedule=schedule, device=emulated)
    gen = torch.Generator().manual_seed(1)
    do, dht, dhbt = (torch.randn(t.shape, generator=gen) for t in (o, ht, hbt))
    full = launcher.ttt_linear_bwd(p, saved, do, dht, dhbt, schedule=schedule, device=emulated)
    needs = GradNeeds(**NEEDS[what])
    emulated.ran.clear()
    got = launcher.ttt_linear_bwd(p, saved, do, dht, dhbt, needs=needs, schedule=schedule,
                                  device=emulated)
    for name in GRAD_INPUTS:
        a, b = got.of(name), full.of(name)
        if getattr(needs, name):
            assert a is not None and torch.equal(a, b), f"d{name} differs from the full backward"
        else:
            assert a is None, f"d{name} computed though not needed"
    assert ("emu_bwd_grads" in emulated.ran) == any(getattr(needs, n) for n in "kvwb")
    if what == "q-only":
        assert emulated.ran == ["emu_bwd_local"], emulated.ran
    _assert_fresh([*(got.of(n) for n in GRAD_INPUTS), o, ht, hbt], [*x.values(), do, dht, dhbt])
