"""No GPU needed: a decode step (a forward without a backward whose every sequence fits in one
chunk) is one launch at any number of chains, dense and packed, with and without states, with
eta_key and every output form: fwd_decode when every sequence has at most
placement.ROW_STEP_ROWS rows (placement.row_step: 16 for every dtype and D_PAD, so every step
at chunk 16), else the fused forward chain writing the outputs (placement.fused_forward: the
cases of more rows, in a chunk of 32 or 64); and
with float32 inputs, or half inputs whose eta, w, b (and eta_key) are in their dtype
(fwd_decode's native_params instance), the launcher does nothing else on the device but
allocate (no cast or copy kernels). A forced Schedule.fuse_forward and a forward with a
backward never take fwd_decode; other shapes keep their schedules."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ttt
from ttt import make_problem
from ttt_cupy import compile as cc
from ttt_cupy import launcher
from ttt_cupy.config import Schedule
from ttt_cupy.placement import FUSED, ROW_STEP_ROWS, forward_plan, row_step
from ttt_cupy.smem import decode_rows, decode_smem_bytes, decode_threads

BT = 16
"""The chunk size of most cases: every step within one such chunk runs fwd_decode."""
BT_LONG = 32
"""A chunk size whose steps of more than ROW_STEP_ROWS rows run the fused chain."""


def _problem(lens, H, D, *, dense=True, init=True, final=True, key=False,
             output="norm_residual", dtype=torch.float32, param_dtype=torch.float32, seed=0,
             eta_float=False, chunk=BT):
    """A problem of CPU tensors (random, none zero) at chunk size ``chunk``: ``init`` True
    (both initial states), False, "state" or "bias" (that one alone); ``eta_float``: eta a
    float (a constant)."""
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
    if init in (True, "state"):
        x["initial_state"] = randn(N, H, D, D, scale=0.1, dt=torch.float32)
    if init in (True, "bias"):
        x["initial_state_bias"] = randn(N, H, 1, D, scale=0.1, dt=torch.float32)
    if key:
        x["eta_key"] = (0.3 + 1.4 * torch.rand(B, T, H, 1, generator=gen)).to(param_dtype)
    if eta_float:
        x["eta"] = 0.05
    p = make_problem(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"], scale=D ** -0.5,
                     eps=1e-6, chunk_size=chunk, initial_state=x.get("initial_state"),
                     initial_state_bias=x.get("initial_state_bias"), output_final_state=final,
                     cu_seqlens=cu, eta_key=x.get("eta_key"), output=output)
    return p, x, cu


DECODE = [  # sequence lengths (all within one chunk), heads, dense, chunk size
    ((1,), 1, True, BT),                # one token, one chain
    ((1,) * 4, 8, True, BT),            # a batch of generation steps
    ((5,) * 2, 2, True, BT),            # five tokens each
    ((BT,) * 2, 4, True, BT),           # a whole chunk (prefill of a short prompt): 16 rows
    ((17,) * 2, 2, True, BT_LONG),      # 17 rows: the fused chain
    ((BT,) * 2, 2, True, BT_LONG),      # 16 rows of a chunk of 32: fwd_decode
    ((BT_LONG,) * 2, 4, True, BT_LONG),  # a whole chunk of 32
    ((1, 5, BT), 2, False, BT),         # packed
    ((1, 20, BT_LONG), 2, False, BT_LONG),  # packed, past 16 rows
    ((3, 0, 1), 2, False, BT),          # packed, an empty sequence
    ((3, 0, 17), 2, False, BT_LONG),    # packed, an empty sequence, past 16 rows
    ((1,) * 64, 4, False, BT),          # many chains (256: fused by the count too)
    ((1, 17) * 32, 4, False, BT_LONG),  # many chains past 16 rows
]


def _did(case):
    lens, H, dense, chunk = case
    return f"{'dense' if dense else 'packed'}-N{len(lens)}-T{max(lens)}-H{H}-c{chunk}"


def _decode_kernel(lens) -> bool:
    """Whether a generation step of sequences of ``lens`` (within one chunk) runs fwd_decode:
    at most ROW_STEP_ROWS rows in each, whatever the dtype and head dim."""
    return max(lens) <= ROW_STEP_ROWS


def _decode_name(lens, D, dtype=torch.float32, mma=True, chunk=BT, **variant) -> str:
    """The one kernel a generation step of sequences of ``lens`` at chunk size ``chunk``
    launches: fwd_decode, or the fused forward chain (its tensor-core instance for half
    inputs)."""
    ctype = cc.CTYPES[str(dtype).removeprefix("torch.")]
    if _decode_kernel(lens):
        return cc.kernel_name(cc.DECODE_KERNEL, ctype, cc.d_pad(D), chunk, **variant)
    return cc.kernel_name("fwd_chain", ctype, cc.d_pad(D), chunk, mma and ctype != "float",
                          fused=True, **variant)


def test_cases_take_both_kernels():
    """The cases keep both kernels tested: fwd_decode at chunk 16 (and up to ROW_STEP_ROWS
    rows at chunk 32), the fused chain at chunk 32 past them; the emulated ones both too."""
    taken = {(chunk, _decode_kernel(lens)) for lens, _, _, chunk in DECODE}
    assert taken == {(BT, True), (BT_LONG, True), (BT_LONG, False)}
    assert {_decode_kernel(case[0]) for case in EMULATED} == {True, False}


FORMS = [  # initial states, final states, eta_key, output form
    (False, False, False, "norm_residual"),
    (True, True, False, "norm_residual"),
    (True, False, True, "query_residual"),
    (False, True, True, "raw"),
    (True, True, False, "raw"),
    ("state", True, False, "query_residual"),
    ("bias", True, True, "norm_residual"),
]


@pytest.mark.parametrize("form", FORMS, ids=["-".join(map(str, f)) for f in FORMS])
@pytest.mark.parametrize("case", DECODE, ids=[_did(c) for c in DECODE])
def test_decode_is_one_launch(recording, case, form):
    lens, H, dense, chunk = case
    init, final, key, output = form
    p, _, _ = _problem(lens, H, 32, dense=dense, init=init, final=final, key=key,
                       output=output, chunk=chunk)
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    assert saved is None and (ht is not None) == final
    assert len(recording.launches) == 1, [launch[0] for launch in recording.launches]
    name, grid, block, smem, _ = recording.launches[0]
    assert name == _decode_name(lens, 32, chunk=chunk, key=key, out=output)
    assert grid == len(lens) * H
    if _decode_kernel(lens):   # the block and its rows' shared memory
        assert (block, smem) == (decode_threads(32), decode_smem_bytes(32, decode_rows(
            max(lens))))
    assert not recording.waits


FORMS_IN_TURN = [  # as FORMS; each differs in one from the first
    (False, False, False, "norm_residual"),
    (True, False, False, "norm_residual"),
    (False, True, False, "norm_residual"),
    (False, False, True, "norm_residual"),
    (False, False, False, "query_residual"),
    (False, False, False, "raw"),
]

@pytest.mark.parametrize("lens,chunk", [((1,) * 4, BT), ((BT,) * 4, BT), ((17,) * 4, BT_LONG)],
                         ids=["fwd_decode", "fwd_decode-16-rows", "fused-chain"])
def test_decode_steps_of_every_form_on_one_device(recording, lens, chunk):
    """Steps of each form in turn on one device, each form twice, every scale and eps: each
    launch is its form's kernel (fwd_decode, or the fused chain for a step past the table's
    rows in a chunk of 32), with that call's scalars and that call's output address (what
    the launcher keeps per configuration never leaks into another)."""
    H = 8
    kernel = cc.DECODE_KERNEL if _decode_kernel(lens) else "fwd_chain"
    for step in range(2):
        for init, final, key, output in FORMS_IN_TURN:
            for scale, eps in ((0.125, 1e-6), (0.125, 1e-3), (0.5, 1e-3)):
                p, _, _ = _problem(lens, H, 32, init=init, final=final, key=key,
                                   output=output, seed=step, chunk=chunk)
                p = dataclasses.replace(p, scale=scale, eps=eps)
                recording.launches.clear()
                o, ht, _, _ = launcher.ttt_linear_fwd(p, save_for_backward=False,
                                                      device=recording)
                (name, grid, _, _, args), = recording.launches
                assert name == _decode_name(lens, 32, chunk=chunk, key=key, out=output)
                assert name.startswith(f"ttt_linear_{kernel}<")
                assert grid == len(lens) * H
                assert args.o == o.data_ptr() and args.ht == (ht.data_ptr() if final else 0)
                assert (args.scale, args.eps) == (np.float32(scale), np.float32(eps))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,chunk", [(1, BT), (2, BT), (BT, BT), (BT, BT_LONG), (17, BT_LONG),
                                     (BT_LONG, BT_LONG)])
def test_decode_half_is_one_launch(recording, dtype, T, chunk):
    """Half inputs: fwd_decode up to 16 rows (ROW_STEP_ROWS), the tensor-core fused
    chain for more (in a chunk of 32); one launch either way."""
    p, _, _ = _problem((T,) * 2, 4, 64, dtype=dtype, chunk=chunk)
    launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    (name, *_), = recording.launches
    assert name == _decode_name((T,) * 2, 64, dtype, chunk=chunk)
    assert (cc.DECODE_KERNEL in name) == (T <= 16)


@pytest.mark.parametrize("case", DECODE, ids=[_did(c) for c in DECODE])
def test_decode_with_backward_keeps_its_schedule(recording, case):
    """A forward that saves for a backward keeps the chain-count rule: few chains unfused;
    never fwd_decode (it stores nothing for a backward)."""
    lens, H, dense, chunk = case
    p, _, _ = _problem(lens, H, 32, dense=dense, chunk=chunk)
    launcher.ttt_linear_fwd(p, save_for_backward=True, device=recording)
    names = [launch[0] for launch in recording.launches]
    fused = len(lens) * H >= FUSED.forward_training
    assert any("fwd_out" in n for n in names) != fused
    assert not any(cc.DECODE_KERNEL in n for n in names)


@pytest.mark.parametrize("lens,H,dense", [((BT + 1,), 2, True), ((1, BT + 1), 2, False),
                                          ((40,) * 4, 8, True)])
def test_longer_sequences_keep_their_schedule(recording, lens, H, dense):
    """A sequence past one chunk: the chain-count rule, as before (few chains of one
    checkpoint group: plain, chain then fwd_out)."""
    p, _, _ = _problem(lens, H, 32, dense=dense)
    launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    names = [launch[0] for launch in recording.launches]
    assert len(lens) * H < FUSED.forward_inference
    assert any("fwd_out" in n for n in names) and not any("true>" in n for n in names[:1])
    plan = forward_plan(p, 1, False)
    assert not plan.fuse and not plan.overlap and plan.segments == [(0, 0)]


def test_decode_forced_unfused(recording):
    """Schedule.fuse_forward=False still forces the unfused forward (A/B timing)."""
    p, _, _ = _problem((1,) * 2, 2, 32)
    launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording,
                            schedule=Schedule(fuse_forward=False))
    assert any("fwd_out" in launch[0] for launch in recording.launches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_forced_fused_runs_the_chain(recording, dtype):
    """Schedule.fuse_forward=True forces the fused chain where fwd_decode would run (A/B
    timing of the two kernels)."""
    p, _, _ = _problem((1,) * 2, 2, 32, dtype=dtype)
    launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording,
                            schedule=Schedule(fuse_forward=True))
    (name, *_), = recording.launches
    ctype = cc.CTYPES[str(dtype).removeprefix("torch.")]
    assert name == cc.kernel_name("fwd_chain", ctype, 32, BT, ctype != "float", fused=True)


def _rule_problem(dtype, D, lens, chunk=BT):
    return SimpleNamespace(q=SimpleNamespace(dtype=dtype), D=D, seq_lens=tuple(lens),
                           chunk_size=chunk)


H200_SMEM = 227 * 1024


@pytest.mark.parametrize("dtype,D", [
    (torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 24), (torch.float32, 16),
    (torch.float32, 24), (torch.float32, 64), (torch.float32, 65), (torch.float32, 128)])
def test_row_step_rule(dtype, D):
    """placement.row_step: a generation step runs fwd_decode when its longest sequence has at
    most 16 rows, for every input dtype and D_PAD (an empty sequence beside them counts
    nothing), at chunk 16 (every step) and in chunks of 32 and 64 (the steps of more rows
    run the fused chain); never with a backward, with a forced Schedule.fuse_forward (either
    way), past one chunk, or where its shared memory does not fit the device."""
    rows = ROW_STEP_ROWS
    assert rows == 16
    for chunk in (BT, 32, 64):
        for lens in ((rows,), (1, rows, 0), (rows,) * 3):
            p = _rule_problem(dtype, D, lens, chunk)
            assert row_step(p, False, H200_SMEM)
            assert row_step(p, False, H200_SMEM, Schedule(overlap=True))  # (not fuse_forward)
            assert not row_step(p, True, H200_SMEM)                        # a training forward
            for forced in (True, False):
                assert not row_step(p, False, H200_SMEM, Schedule(fuse_forward=forced))
            need = decode_smem_bytes(cc.d_pad(D), decode_rows(max(lens)))
            assert row_step(p, False, need) and not row_step(p, False, need - 1)
        for lens in ((rows + 1,), (1, rows + 1), (rows, 0, rows + 1)):
            assert not row_step(_rule_problem(dtype, D, lens, chunk), False, H200_SMEM)
        assert not row_step(_rule_problem(dtype, D, (1, chunk + 1), chunk), False, H200_SMEM)
        assert row_step(_rule_problem(dtype, D, (0,), chunk), False, H200_SMEM)  # nothing to run


def test_decode_rows_and_smem():
    """fwd_decode's shared memory holds the step's longest sequence's rows rounded up to a
    power of two (one size for steps of about one length): k, q, v, kh / g and q W tiles of
    D_PAD floats and eta, eta_key per row; threads 128, at D_PAD 128 256."""
    assert [decode_rows(n) for n in (0, 1, 2, 3, 4, 5, 16, 17, 64)] == [1, 1, 2, 4, 4, 8, 16,
                                                                         32, 64]
    for dp in (16, 32, 64, 128):
        assert decode_smem_bytes(dp, 4) == 4 * 4 * (5 * dp + 2)
        assert decode_threads(dp) == (256 if dp == 128 else 128)


def test_decode_setup_is_kept(recording):
    """A dense generation step seen before takes its kept setup (kernel, block, shared
    memory, scalars); its launch takes the new call's tensors."""
    for seed in range(3):
        p, _, _ = _problem((1,) * 3, 2, 32, seed=seed)
        recording.launches.clear()
        o, ht, _, _ = launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
        (name, _, _, _, args), = recording.launches
        assert cc.DECODE_KERNEL in name
        assert (args.q, args.ht, args.o) == (p.q.data_ptr(), ht.data_ptr(), o.data_ptr())
    kept = [setup for key, setup in launcher._FORWARD_SETUPS.items() if key[0] is recording]
    assert len(kept) == 1 and isinstance(kept[0], launcher._DecodeSetup)


class _Ops(TorchDispatchMode):
    """The aten operators run under it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


ALLOCATIONS = {"empty", "empty_like", "empty_strided"}


@pytest.mark.parametrize("lens,dense,chunk", [((1,) * 2, True, BT), ((17,) * 2, True, BT_LONG),
                                              ((1, 0, 4), False, BT)],
                         ids=["dense-fwd_decode", "dense-fused-chain", "packed-fwd_decode"])
@pytest.mark.parametrize("form", FORMS, ids=["-".join(map(str, f)) for f in FORMS])
def test_decode_float32_only_allocates(recording, form, lens, dense, chunk):
    """float32 inputs: besides its one launch (fwd_decode or the fused chain), the launcher
    only allocates (the outputs and final states): no cast, copy or fill of an input that is
    float32 already."""
    init, final, key, output = form
    p, _, _ = _problem(lens, 4, 32, init=init, final=final, key=key, output=output,
                       dense=dense, chunk=chunk)
    with _Ops() as ops:
        launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    assert set(ops.ops) <= ALLOCATIONS, ops.ops
    (name, *_), = recording.launches
    assert (cc.DECODE_KERNEL in name) == _decode_kernel(lens)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", FORMS, ids=["-".join(map(str, f)) for f in FORMS])
def test_decode_half_native_params_only_allocates(recording, form, dtype):
    """Half inputs with eta, w, b (and eta_key) in their dtype (the usual generation call):
    fwd_decode's native_params instance (P = T: it widens them on load) takes the inputs
    themselves; besides its one launch the launcher only allocates, no cast."""
    init, final, key, output = form
    p, _, _ = _problem((1,) * 2, 4, 32, init=init, final=final, key=key, output=output,
                       dtype=dtype, param_dtype=dtype)
    with _Ops() as ops:
        launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    assert set(ops.ops) <= ALLOCATIONS, ops.ops
    (name, _, _, _, args), = recording.launches
    assert name == _decode_name((1,), 32, dtype, key=key, out=output, native_params=True)
    assert name.endswith(f", {cc.CTYPES[str(dtype).removeprefix('torch.')]}>")
    given = (p.eta, p.w, p.b, p.eta_key)
    assert [args.eta, args.lnw, args.lnb, args.ekey] == [0 if t is None else t.data_ptr()
                                                         for t in given]


@pytest.mark.parametrize("key", [False, True], ids=["no-key", "key"])
def test_decode_half_mixed_params_cast(recording, key):
    """Half inputs with a float32 w among bfloat16 eta, b (and eta_key): the fp32 instance
    (P = float) as before, the bfloat16 ones cast (one each), w as it is. The kept setup of a
    shape never leaks between the two instances."""
    p, _, _ = _problem((1,) * 2, 4, 32, key=key, dtype=torch.bfloat16,
                       param_dtype=torch.bfloat16)
    mixed = dataclasses.replace(p, w=p.w.float())
    for problem, native in ((p, True), (mixed, False), (p, True)):
        recording.launches.clear()
        with _Ops() as ops:
            launcher.ttt_linear_fwd(problem, save_for_backward=False, device=recording)
        casts = [op for op in ops.ops if op not in ALLOCATIONS]
        assert casts == ([] if native else ["_to_copy"] * (3 if key else 2)), ops.ops
        (name, _, _, _, args), = recording.launches
        assert name == _decode_name((1,), 32, torch.bfloat16, key=key, native_params=native)
        assert args.lnw == problem.w.data_ptr()    # (float32 already: read as it is)
        if not native:
            assert args.eta != problem.eta.data_ptr()


@pytest.mark.parametrize("T,chunk", [(1, BT), (17, BT_LONG)], ids=["fwd_decode", "fused-chain"])
def test_decode_half_params_cast_once(recording, T, chunk):
    """float32 inputs, bfloat16 eta, w, b: one cast each (the kernels read them in fp32),
    nothing else."""
    p, _, _ = _problem((T,) * 2, 4, 32, param_dtype=torch.bfloat16, chunk=chunk)
    with _Ops() as ops:
        launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    assert [op for op in ops.ops if op not in ALLOCATIONS] == ["_to_copy"] * 3, ops.ops
    (name, *_), = recording.launches
    assert (cc.DECODE_KERNEL in name) == (T <= 16)


EMULATED = [  # sequence lengths, heads, dense, initial states, eta_key, output form,
    # eta / w / b dtype, head dim, eta a float, chunk size (the fused chain's variants with
    # eta_key or another output form are emulated at chunk 16, and at D_PAD 128 at chunk 64)
    ((1,) * 3, 2, True, True, False, "norm_residual", torch.float32, 20, False, BT),
    ((BT,) * 2, 1, True, False, False, "norm_residual", torch.float32, 20, False, BT),
    ((20,) * 2, 1, True, False, False, "norm_residual", torch.float32, 20, False, BT_LONG),
    ((1, 9, BT), 2, False, True, True, "query_residual", torch.bfloat16, 20, False, BT),
    ((1, 9, 30), 2, False, True, False, "norm_residual", torch.bfloat16, 20, False, BT_LONG),
    ((1, 17, 40), 1, False, True, True, "query_residual", torch.bfloat16, 100, False, 64),
    ((5, 0, 1), 1, False, True, False, "raw", torch.float16, 20, False, BT),
    ((17, 0, 1), 1, False, True, False, "raw", torch.float16, 100, False, 64),
    ((1, 0, 4, 1), 2, False, True, True, "query_residual", torch.float32, 20, False, BT),
    ((3,) * 2, 2, True, "state", False, "raw", torch.bfloat16, 64, True, BT),
    ((24,) * 2, 2, True, "state", False, "norm_residual", torch.bfloat16, 64, True, BT_LONG),
    ((4,) * 2, 1, True, "bias", True, "norm_residual", torch.float32, 64, False, BT),
    ((1,) * 2, 2, True, False, True, "raw", torch.float32, 64, True, BT),
    ((16,) * 1, 1, True, True, True, "query_residual", torch.float32, 100, False, BT),
    ((16,) * 1, 1, True, True, True, "query_residual", torch.float32, 100, False, 64),
    ((17,) * 1, 1, True, "bias", True, "raw", torch.float32, 100, False, 64),
]


@pytest.mark.parametrize("case", EMULATED, ids=[
    f"{'dense' if c[2] else 'packed'}-{'+'.join(map(str, c[0]))}-H{c[1]}-"
    f"{'h0' if c[3] is True else 'no-h0' if not c[3] else c[3]}-{'key-' if c[4] else ''}"
    f"{c[5]}-{str(c[6])[6:]}-D{c[7]}{'-eta-float' if c[8] else ''}-c{c[9]}"
    for c in EMULATED])
def test_decode_end_to_end_matches_reference(emulated, case):
    """The one launch (fwd_decode up to 16 rows, the fused chain for more, in a chunk of 32
    or 64) run by the emulation: outputs and final states against the reference backend in
    float64."""
    lens, H, dense, init, key, output, param_dtype, D, eta_float, chunk = case
    p, x, cu = _problem(lens, H, D, dense=dense, init=init, key=key, output=output,
                        param_dtype=param_dtype, seed=3, eta_float=eta_float, chunk=chunk)
    emulated.inputs = [t for t in (*x.values(), cu, p.eta) if isinstance(t, torch.Tensor)]
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, save_for_backward=False, device=emulated)
    want = "emu_fwd_decode" if _decode_kernel(lens) else "emu_fwd_chain_fused"
    assert emulated.ran == [want] and saved is None
    ref_in = {name: t.double() if isinstance(t, torch.Tensor) else t for name, t in x.items()}
    ro, rht, rhbt = ttt.chunk_ttt_linear(**ref_in, scale=D ** -0.5, eps=1e-6, chunk_size=chunk,
                                         output_final_state=True, cu_seqlens=cu,
                                         output=output, backend="reference")
    for what, a, b in (("o", o, ro), ("ht", ht, rht), ("hbt", hbt, rhbt)):
        assert a.shape == b.shape, what
        err = float((a.double() - b).norm() / b.norm())
        assert err < 2e-4, f"{what}: relative error {err:.2e}"
    for n, length in enumerate(lens if not dense else ()):
        if length == 0:   # an empty sequence's states pass through (the op drops those)
            h0 = x.get("initial_state")
            assert torch.equal(ht[n], h0[n] if h0 is not None else torch.zeros_like(ht[n]))
