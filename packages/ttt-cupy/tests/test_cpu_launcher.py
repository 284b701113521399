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

import ctypes
import types

import pytest
import torch

import ttt
from ttt import make_problem
from ttt_cupy import launcher

np = pytest.importorskip("numpy")

_C = {np.uint64: ctypes.c_void_p, np.float32: ctypes.c_float, np.int32: ctypes.c_int,
      np.int64: ctypes.c_longlong}


def _entry(name: str) -> tuple[str, int, int]:
    """(emulation entry point, D_PAD, BT) of a name expression such as
    ``ttt_linear_fwd_chain<float, 64, 16, false, true>``."""
    base, _, targs = name.partition("<")
    t, dp, bt, mma, *fuse = (a.strip() for a in targs.rstrip(">").split(","))
    assert (t, mma) == ("float", "false"), f"{name}: only float SIMT instances run here"
    return f"emu_{base.removeprefix('ttt_linear_')}{'_fused' if fuse == ['true'] else ''}", \
        int(dp), int(bt)


@pytest.fixture
def emulated(emu, stand_in_device, allocations, monkeypatch):
    """The launcher on device 0 (an sm_90 stand-in) with CPU tensors, each launch run by the
    emulation with the tensors of the call registered as its arrays (prefetch hints and
    asynchronous copies must stay inside them). Returns the emulation's state: ``ran``, the
    entry points run; ``inputs``, the caller's tensors (to set before the call)."""
    state = types.SimpleNamespace(ran=[], inputs=[])

    def launch(kernel, index, grid, block, smem, args, stream):
        entry, dp, bt = _entry(kernel.name)
        emu.emu_clear_buffers()
        for t in allocations + state.inputs:
            storage = t.untyped_storage()
            emu.emu_add_buffer(ctypes.c_void_p(storage.data_ptr()),
                               ctypes.c_longlong(storage.nbytes()))
        c_args = [_C[type(a)](float(a) if isinstance(a, np.floating) else int(a))
                  for a in args[:-1]]                    # (the last: the smem size)
        rc = getattr(emu, entry)(ctypes.c_int(dp), ctypes.c_int(bt), ctypes.c_longlong(grid),
                                 *c_args)
        assert rc == 0, f"no emulated {entry} for D_PAD {dp}, BT {bt}"
        assert emu.emu_prefetch_strays() == 0, f"{entry}: prefetch hints outside its arrays"
        assert emu.emu_async_strays() == 0, f"{entry}: asynchronous copies outside its arrays"
        assert emu.emu_async_leftovers() == 0, f"{entry}: asynchronous copies never waited for"
        state.ran.append(entry)

    monkeypatch.setattr(launcher, "_launch", launch)
    monkeypatch.setattr(launcher, "_stream_wait_value", lambda stream, address, value: False)
    return state


def _inputs(D, lens, H, param_dtype, init, seed=0):
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
    cu = None
    if N > 1:
        cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    return x, cu


CASES = [  # D, sequence lengths, heads, eta / w / b dtype, initial states, environment
    (64, (300,), 2, torch.float32, True, {launcher.OVERLAP_ENV: "0"}),     # one launch each
    (64, (300,), 2, torch.bfloat16, False, {launcher.SEGMENT_ENV: "2"}),   # segments
    (20, (150, 170), 1, torch.float16, True, {launcher.OVERLAP_ENV: "1"}),  # overlapped, varlen
    (64, (90,), 2, torch.float64, True, {launcher.FUSE_ENV: "1"}),         # fused forward
    (32, (40, 7, 60), 2, torch.bfloat16, False, {}),                       # the rule
]


def _id(case):
    D, lens, H, dt, init, env = case
    what = ",".join(f"{k.removeprefix('TTT_CUPY_')}={v}" for k, v in env.items()) or "rule"
    return f"D{D}-{'+'.join(map(str, lens))}-H{H}-{str(dt).split('.')[1]}-" \
           f"{'h0' if init else 'no-h0'}-{what}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_launcher_end_to_end_matches_reference(emulated, monkeypatch, case):
    D, lens, H, param_dtype, init, env = case
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    x, cu = _inputs(D, lens, H, param_dtype, init)
    scale, eps, bt = D ** -0.5, 1e-6, 16
    p = make_problem(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"], scale=scale, eps=eps,
                     chunk_size=bt, initial_state=x.get("initial_state"),
                     initial_state_bias=x.get("initial_state_bias"), output_final_state=True,
                     cu_seqlens=cu)
    emulated.inputs = [t for t in (*x.values(), cu) if t is not None]
    before = {name: t.clone() for name, t in x.items()}
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, save_for_backward=True)
    gen = torch.Generator().manual_seed(1)
    do, dht, dhbt = (torch.randn(t.shape, generator=gen) for t in (o, ht, hbt))
    dq, dk, dv, dw, db, deta, dh0, dhb0 = launcher.ttt_linear_bwd(p, saved, do, dht, dhbt)
    assert {"emu_fwd_chain", "emu_fwd_chain_fused"} & set(emulated.ran), emulated.ran
    for name, t in x.items():  # inputs are never mutated
        assert torch.equal(t, before[name]), name

    ref_in = {name: t.detach().double().requires_grad_() for name, t in x.items()}
    ro, rht, rhbt = ttt.chunk_ttt_linear(**ref_in, scale=scale, eps=eps, chunk_size=bt,
                                         output_final_state=True, cu_seqlens=cu,
                                         backend="reference")
    grads = torch.autograd.grad((ro, rht, rhbt), list(ref_in.values()),
                                (do.double(), dht.double(), dhbt.double()))
    ref = dict(zip(ref_in, grads))
    got = dict(q=dq, k=dk, v=dv, w=dw, b=db, eta=deta, initial_state=dh0,
               initial_state_bias=dhb0)

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    for what, a, b in (("o", o, ro), ("ht", ht, rht), ("hbt", hbt, rhbt),
                       *((f"d{name}", got[name], ref[name]) for name in ref_in)):
        assert a.shape == b.shape, what
        assert rel(a, b.detach()) < 2e-4, f"{what}: relative error {rel(a, b.detach()):.2e}"
