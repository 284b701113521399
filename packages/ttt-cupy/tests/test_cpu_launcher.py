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
from ttt import make_problem
from ttt_cupy import launcher
from ttt_cupy.config import AUTO, Schedule


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
    D, lens, H, param_dtype, init, schedule = case
    x, cu = _inputs(D, lens, H, param_dtype, init)
    scale, eps, bt = D ** -0.5, 1e-6, 16
    p = make_problem(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"], scale=scale, eps=eps,
                     chunk_size=bt, initial_state=x.get("initial_state"),
                     initial_state_bias=x.get("initial_state_bias"), output_final_state=True,
                     cu_seqlens=cu)
    emulated.inputs = [t for t in (*x.values(), cu) if t is not None]
    before = {name: t.clone() for name, t in x.items()}
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, save_for_backward=True, schedule=schedule,
                                                device=emulated)
    gen = torch.Generator().manual_seed(1)
    do, dht, dhbt = (torch.randn(t.shape, generator=gen) for t in (o, ht, hbt))
    dq, dk, dv, dw, db, deta, dh0, dhb0 = launcher.ttt_linear_bwd(
        p, saved, do, dht, dhbt, schedule=schedule, device=emulated)
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
