"""No GPU needed: a decode step (a forward without a backward whose every sequence fits in one
chunk) is one launch, the fused forward chain writing the outputs (placement.fused_forward),
at any number of chains, dense and packed, with and without states, with eta_key and every
output form; and with float32 inputs the launcher does nothing else on the device but
allocate (no cast or copy kernels). Other shapes keep their schedules."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ttt
from ttt import make_problem
from ttt_cupy import compile as cc
from ttt_cupy import launcher
from ttt_cupy.config import Schedule
from ttt_cupy.placement import FUSED, forward_plan

BT = 16


def _problem(lens, H, D, *, dense=True, init=True, final=True, key=False,
             output="norm_residual", dtype=torch.float32, param_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = len(lens)

    def randn(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, generator=gen)).to(dt)

    if dense:
        assert len(set(lens)) == 1
        B, T, cu = N, lens[0], None
    else:
        B, T = 1, sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    k = randn(B, T, H, D)
    k = (k / k.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)).to(dtype)
    x = dict(q=randn(B, T, H, D), k=k, v=randn(B, T, H, D),
             w=randn(H, D, scale=0.1, dt=param_dtype) + 1, b=randn(H, D, scale=0.1,
                                                                  dt=param_dtype),
             eta=(0.1 * torch.rand(B, T, H, 1, generator=gen)).to(param_dtype))
    if init:
        x["initial_state"] = randn(N, H, D, D, scale=0.1, dt=torch.float32)
        x["initial_state_bias"] = randn(N, H, 1, D, scale=0.1, dt=torch.float32)
    if key:
        x["eta_key"] = (0.3 + 1.4 * torch.rand(B, T, H, 1, generator=gen)).to(param_dtype)
    p = make_problem(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"], scale=D ** -0.5,
                     eps=1e-6, chunk_size=BT, initial_state=x.get("initial_state"),
                     initial_state_bias=x.get("initial_state_bias"), output_final_state=final,
                     cu_seqlens=cu, eta_key=x.get("eta_key"), output=output)
    return p, x, cu


DECODE = [  # sequence lengths (all within one chunk), heads, dense
    ((1,), 1, True),              # one token, one chain
    ((1,) * 4, 8, True),          # a batch of generation steps
    ((BT,) * 2, 4, True),         # a whole chunk (prefill of a short prompt)
    ((1, 5, BT), 2, False),       # packed
    ((3, 0, 1), 2, False),        # packed, an empty sequence
    ((1,) * 64, 4, False),        # many chains (256: fused by the count too)
]


def _did(case):
    lens, H, dense = case
    return f"{'dense' if dense else 'packed'}-N{len(lens)}-T{max(lens)}-H{H}"


FORMS = [  # initial states, final states, eta_key, output form
    (False, False, False, "norm_residual"),
    (True, True, False, "norm_residual"),
    (True, False, True, "query_residual"),
    (False, True, True, "raw"),
    (True, True, False, "raw"),
]


@pytest.mark.parametrize("form", FORMS, ids=["-".join(map(str, f)) for f in FORMS])
@pytest.mark.parametrize("case", DECODE, ids=[_did(c) for c in DECODE])
def test_decode_is_one_launch(recording, case, form):
    lens, H, dense = case
    init, final, key, output = form
    p, _, _ = _problem(lens, H, 32, dense=dense, init=init, final=final, key=key,
                       output=output)
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    assert saved is None and (ht is not None) == final
    assert len(recording.launches) == 1, [launch[0] for launch in recording.launches]
    name, grid, *_ = recording.launches[0]
    variant = dict(key=key, out=output)
    assert name == cc.kernel_name("fwd_chain", "float", 32, BT, False, fused=True, **variant)
    assert grid == len(lens) * H
    assert not recording.waits


FORMS_IN_TURN = [  # as FORMS; each differs in one from the first
    (False, False, False, "norm_residual"),
    (True, False, False, "norm_residual"),
    (False, True, False, "norm_residual"),
    (False, False, True, "norm_residual"),
    (False, False, False, "query_residual"),
    (False, False, False, "raw"),
]


def test_decode_steps_of_every_form_on_one_device(recording):
    """Steps of each form in turn on one device, each form twice, every scale and eps: each
    launch is its form's kernel, with that call's scalars and that call's output address
    (what the launcher keeps per configuration never leaks into another)."""
    lens, H, dense = DECODE[1]
    for step in range(2):
        for init, final, key, output in FORMS_IN_TURN:
            for scale, eps in ((0.125, 1e-6), (0.125, 1e-3), (0.5, 1e-3)):
                p, _, _ = _problem(lens, H, 32, dense=dense, init=init, final=final, key=key,
                                   output=output, seed=step)
                p = dataclasses.replace(p, scale=scale, eps=eps)
                recording.launches.clear()
                o, ht, _, _ = launcher.ttt_linear_fwd(p, save_for_backward=False,
                                                      device=recording)
                (name, grid, _, _, args), = recording.launches
                assert name == cc.kernel_name("fwd_chain", "float", 32, BT, False, fused=True,
                                              key=key, out=output)
                assert grid == len(lens) * H
                assert args[14] == o.data_ptr() and args[8] == (ht.data_ptr() if final else 0)
                assert (args[19], args[20]) == (np.float32(scale), np.float32(eps))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_is_one_launch(recording, dtype):
    """Half inputs: the tensor-core fused chain, still one launch."""
    p, _, _ = _problem((1,) * 2, 4, 64, dtype=dtype)
    launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    (name, *_), = recording.launches
    ctype = cc.CTYPES[str(dtype).removeprefix("torch.")]
    assert name == cc.kernel_name("fwd_chain", ctype, 64, BT, True, fused=True)


@pytest.mark.parametrize("case", DECODE[:4], ids=[_did(c) for c in DECODE[:4]])
def test_decode_with_backward_keeps_its_schedule(recording, case):
    """A forward that saves for a backward keeps the chain-count rule: few chains unfused."""
    lens, H, dense = case
    p, _, _ = _problem(lens, H, 32, dense=dense)
    launcher.ttt_linear_fwd(p, save_for_backward=True, device=recording)
    names = [launch[0] for launch in recording.launches]
    fused = len(lens) * H >= FUSED["forward_training"]
    assert any("fwd_out" in n for n in names) != fused


@pytest.mark.parametrize("lens,H,dense", [((BT + 1,), 2, True), ((1, BT + 1), 2, False),
                                          ((40,) * 4, 8, True)])
def test_longer_sequences_keep_their_schedule(recording, lens, H, dense):
    """A sequence past one chunk: the chain-count rule, as before (few chains of one
    checkpoint group: plain, chain then fwd_out)."""
    p, _, _ = _problem(lens, H, 32, dense=dense)
    launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    names = [launch[0] for launch in recording.launches]
    assert len(lens) * H < FUSED["forward_inference"]
    assert any("fwd_out" in n for n in names) and not any("true>" in n for n in names[:1])
    plan = forward_plan(p, 1, False)
    assert not plan.fuse and not plan.overlap and plan.segments == [(0, 0)]


def test_decode_forced_unfused(recording):
    """Schedule.fuse_forward=False still forces the unfused forward (A/B timing)."""
    p, _, _ = _problem((1,) * 2, 2, 32)
    launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording,
                            schedule=Schedule(fuse_forward=False))
    assert any("fwd_out" in launch[0] for launch in recording.launches)


class _Ops(TorchDispatchMode):
    """The aten operators run under it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


ALLOCATIONS = {"empty", "empty_like", "empty_strided"}


@pytest.mark.parametrize("form", FORMS, ids=["-".join(map(str, f)) for f in FORMS])
def test_decode_float32_only_allocates(recording, form):
    """Dense float32 inputs: besides its one launch, the launcher only allocates (the outputs
    and final states): no cast, copy or fill of an input that is float32 already."""
    init, final, key, output = form
    p, _, _ = _problem((1,) * 2, 4, 32, init=init, final=final, key=key, output=output)
    with _Ops() as ops:
        launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    assert set(ops.ops) <= ALLOCATIONS, ops.ops
    assert len(recording.launches) == 1


def test_decode_half_params_cast_once(recording):
    """bfloat16 eta, w, b: one cast each (the kernels read them in fp32), nothing else."""
    p, _, _ = _problem((1,) * 2, 4, 32, param_dtype=torch.bfloat16)
    with _Ops() as ops:
        launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    assert [op for op in ops.ops if op not in ALLOCATIONS] == ["_to_copy"] * 3, ops.ops


EMULATED = [  # sequence lengths, heads, dense, initial states, eta_key, output form, dtype
    ((1,) * 3, 2, True, True, False, "norm_residual", torch.float32),
    ((BT,) * 2, 1, True, False, False, "norm_residual", torch.float32),
    ((1, 9, BT), 2, False, True, True, "query_residual", torch.bfloat16),
    ((5, 0, 1), 1, False, True, False, "raw", torch.float16),
]


@pytest.mark.parametrize("case", EMULATED, ids=[
    f"{'dense' if c[2] else 'packed'}-{'+'.join(map(str, c[0]))}-H{c[1]}-"
    f"{'h0' if c[3] else 'no-h0'}-{'key-' if c[4] else ''}{c[5]}-{str(c[6])[6:]}"
    for c in EMULATED])
def test_decode_end_to_end_matches_reference(emulated, case):
    """The one fused launch run by the emulation: outputs and final states against the
    reference backend in float64."""
    lens, H, dense, init, key, output, param_dtype = case
    D = 20
    p, x, cu = _problem(lens, H, D, dense=dense, init=init, key=key, output=output,
                        param_dtype=param_dtype, seed=3)
    emulated.inputs = [t for t in (*x.values(), cu) if t is not None]
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, save_for_backward=False, device=emulated)
    assert emulated.ran == ["emu_fwd_chain_fused"] and saved is None
    ref_in = {name: t.double() for name, t in x.items()}
    ro, rht, rhbt = ttt.chunk_ttt_linear(**ref_in, scale=D ** -0.5, eps=1e-6, chunk_size=BT,
                                         output_final_state=True, cu_seqlens=cu,
                                         output=output, backend="reference")
    for what, a, b in (("o", o, ro), ("ht", ht, rht), ("hbt", hbt, rhbt)):
        assert a.shape == b.shape, what
        err = float((a.double() - b).norm() / b.norm())
        assert err < 2e-4, f"{what}: relative error {err:.2e}"
