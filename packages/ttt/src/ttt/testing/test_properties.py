"""Properties every backend must have, beyond matching the oracle."""

from __future__ import annotations

import pytest
import torch

from ..tolerances import TOLERANCES
from .calls import gradients, outputs_and_grads, run_op, skip_unless_supported
from .cases import (
    BF16,
    DTYPE_NAMES,
    F16,
    F32,
    STATE_NAMES,
    Case,
    differentiable,
    make_inputs,
)
from .compare import expect, expect_close
from .expected import oracle_forward

PROPERTY_DTYPES = [pytest.param(d, id=DTYPE_NAMES[d]) for d in (F32, BF16, F16)]


def _cotangents(outputs, seed=7):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(x.shape, generator=g).to(device=x.device, dtype=x.dtype)
            for x in outputs]


@pytest.mark.parametrize("dtype", PROPERTY_DTYPES)
def test_varlen_equals_each_sequence_alone(dtype, ttt_backend, ttt_backend_name, ttt_device):
    """A packed batch gives each sequence's outputs, final states and gradients of a call
    on that sequence alone (dw, db: the sum over the sequences)."""
    lens = (5, 16, 1, 33, 20)
    case = Case(1, sum(lens), 2, 32, 16, dtype, seq_lens=lens)
    packed = differentiable(make_inputs(case, ttt_device, seed=11))
    skip_unless_supported(ttt_backend, packed)
    o, ht, hbt = run_op(ttt_backend_name, packed)
    cots = _cotangents((o, ht, hbt))
    grads = gradients(packed, [o, ht, hbt], cots)
    out_tol, grad_tol = TOLERANCES[dtype]

    shared = {"w": torch.zeros_like(grads["w"], dtype=torch.float64),
              "b": torch.zeros_like(grads["b"], dtype=torch.float64)}
    start = 0
    for n, length in enumerate(lens):
        sl = slice(start, start + length)
        alone = {"chunk_size": 16, "output_final_state": True}
        for name in ("q", "k", "v", "eta"):
            alone[name] = packed[name][:, sl].detach().clone().requires_grad_(True)
        for name in ("w", "b"):
            alone[name] = packed[name].detach().clone().requires_grad_(True)
        for name in STATE_NAMES:
            alone[name] = packed[name][n:n + 1].detach().clone().requires_grad_(True)
        out_n = run_op(ttt_backend_name, alone)
        expect_close(f"o of sequence {n}", o[:, sl], out_n[0], out_tol)
        expect_close(f"final_state of sequence {n}", ht[n:n + 1], out_n[1], out_tol)
        expect_close(f"final_state_bias of sequence {n}", hbt[n:n + 1], out_n[2], out_tol)
        grads_n = gradients(alone, list(out_n), [cots[0][:, sl], cots[1][n:n + 1],
                                                 cots[2][n:n + 1]])
        for name in ("q", "k", "v", "eta"):
            expect_close(f"d{name} of sequence {n}", grads[name][:, sl], grads_n[name],
                         grad_tol)
        for name in STATE_NAMES:
            expect_close(f"d{name} of sequence {n}", grads[name][n:n + 1], grads_n[name],
                         grad_tol)
        for name in shared:
            shared[name] += grads_n[name].double()
        start += length
    for name, total in shared.items():
        expect_close(f"d{name} (sum over the sequences alone)", grads[name], total, grad_tol)


@pytest.mark.parametrize("dtype", PROPERTY_DTYPES)
def test_split_at_chunk_boundary_equals_one_call(dtype, ttt_backend, ttt_backend_name, ttt_device):
    case = Case(2, 96, 2, 32, 16, dtype)
    whole = differentiable(make_inputs(case, ttt_device, seed=21))
    skip_unless_supported(ttt_backend, whole)
    (o, ht, hbt), grads = outputs_and_grads(ttt_backend_name, whole)

    split = 48  # a multiple of the chunk size
    first = {name: whole[name] for name in ("w", "b", "initial_state", "initial_state_bias")}
    first.update(chunk_size=16, output_final_state=True)
    second = {name: whole[name] for name in ("w", "b")}
    second.update(chunk_size=16, output_final_state=True)
    for name in ("q", "k", "v", "eta"):
        first[name] = whole[name][:, :split]
        second[name] = whole[name][:, split:]
    o1, ht1, hbt1 = run_op(ttt_backend_name, first)
    o2, ht2, hbt2 = run_op(ttt_backend_name, {**second, "initial_state": ht1,
                                          "initial_state_bias": hbt1})
    out_tol, grad_tol = TOLERANCES[dtype]
    expect_close("o", torch.cat([o1, o2], dim=1), o, out_tol)
    expect_close("final_state", ht2, ht, out_tol)
    expect_close("final_state_bias", hbt2, hbt, out_tol)

    g = torch.Generator(device="cpu").manual_seed(7)
    cots = [torch.randn(x.shape, generator=g).to(device=x.device, dtype=x.dtype)
            for x in (o, ht, hbt)]
    names = list(grads)
    split_grads = torch.autograd.grad(
        [torch.cat([o1, o2], dim=1), ht2, hbt2], [whole[n] for n in names], cots)
    for name, grad in zip(names, split_grads):
        expect_close(f"d{name}", grad, grads[name], grad_tol)


@pytest.mark.parametrize("dtype", PROPERTY_DTYPES)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_bitwise_deterministic(dtype, varlen, ttt_backend, ttt_backend_name, ttt_device):
    """Repeated identical calls give bitwise identical outputs and gradients, for backends
    that declare ``Capabilities.deterministic``."""
    if not ttt_backend.capabilities.deterministic:
        pytest.skip(f"{ttt_backend_name} declares deterministic=False")
    case = Case(1, 70, 3, 64, 16, dtype, seq_lens=(30, 40) if varlen else None) if varlen \
        else Case(2, 70, 3, 64, 16, dtype)
    inputs = differentiable(make_inputs(case, ttt_device, seed=31))
    skip_unless_supported(ttt_backend, inputs)
    first_out, first_grads = outputs_and_grads(ttt_backend_name, inputs)
    for _ in range(2):
        out, grads = outputs_and_grads(ttt_backend_name, inputs)
        for i, (a, b) in enumerate(zip(out, first_out)):
            expect(torch.equal(a, b), f"output {i} differs between identical calls")
        for name in grads:
            expect(torch.equal(grads[name], first_grads[name]), f"d{name} differs between calls")


@pytest.mark.parametrize("dtype", PROPERTY_DTYPES)
def test_inputs_are_not_modified(dtype, ttt_backend, ttt_backend_name, ttt_device):
    case = Case(2, 37, 2, 32, 16, dtype)
    inputs = differentiable(make_inputs(case, ttt_device, seed=41))
    skip_unless_supported(ttt_backend, inputs)
    before = {n: t.detach().clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    outputs_and_grads(ttt_backend_name, inputs)
    for name, saved in before.items():
        expect(torch.equal(inputs[name].detach(), saved), f"{name} was modified")


@pytest.mark.parametrize("dtype", PROPERTY_DTYPES)
def test_strided_views_give_the_contiguous_results(dtype, ttt_backend, ttt_backend_name,
                                                   ttt_device):
    """The op takes strided views of q, k, v, eta, w and the initial state (the core makes
    them contiguous before any backend sees them) and gives bitwise the results of the
    contiguous inputs."""
    case = Case(2, 37, 2, 32, 16, dtype)
    inputs = differentiable(make_inputs(case, ttt_device, seed=51))
    skip_unless_supported(ttt_backend, inputs)
    (o, ht, hbt), grads = outputs_and_grads(ttt_backend_name, inputs)

    strided = dict(inputs)
    for name in ("q", "k", "v", "eta"):  # [B, H, T, D] storage seen as [B, T, H, D]
        x = inputs[name].detach().transpose(1, 2).contiguous().transpose(1, 2)
        strided[name] = x.requires_grad_(True)
        expect(not strided[name].is_contiguous() or name == "eta",
               f"{name}: the strided view came out contiguous")
    strided["w"] = inputs["w"].detach().t().contiguous().t().requires_grad_(True)
    strided["initial_state"] = (inputs["initial_state"].detach().transpose(-1, -2)
                                .contiguous().transpose(-1, -2).requires_grad_(True))
    (o2, ht2, hbt2), grads2 = outputs_and_grads(ttt_backend_name, strided)
    for label, a, b in (("o", o2, o), ("final_state", ht2, ht), ("final_state_bias", hbt2, hbt)):
        expect(torch.equal(a, b), f"{label} differs for non-contiguous inputs")
    for name in grads:
        expect(torch.equal(grads2[name], grads[name]), f"d{name} differs for non-contiguous inputs")


def test_runs_on_the_current_stream(ttt_backend, ttt_backend_name, ttt_device):
    """Forward and backward run on PyTorch's current stream: the inputs are filled on a
    side stream behind a long sleep, and the op, called under that stream, must wait."""
    if ttt_device.type != "cuda":
        pytest.skip("streams: needs a CUDA device")
    case = Case(2, 70, 2, 32, 16, BF16)
    inputs = differentiable(make_inputs(case, ttt_device, seed=61))
    skip_unless_supported(ttt_backend, inputs)
    want_out, want_grads = outputs_and_grads(ttt_backend_name, inputs)
    late = dict(inputs)
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            late[name] = torch.full_like(t.detach(), float("nan")).requires_grad_(t.requires_grad)
    torch.cuda.synchronize(ttt_device)
    side = torch.cuda.Stream(ttt_device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)          # about 0.1 s of GPU clock cycles
        with torch.no_grad():
            for name, t in late.items():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.copy_(inputs[name])
        out, grads = outputs_and_grads(ttt_backend_name, late)
    side.synchronize()
    for i, (a, b) in enumerate(zip(out, want_out)):
        expect(torch.equal(a, b), f"output {i}: not run on the current stream (read NaN inputs)")
    for name in want_grads:
        expect(torch.equal(grads[name], want_grads[name]),
               f"d{name}: not run on the current stream (read NaN inputs)")


def test_final_states_none_unless_requested(ttt_backend, ttt_backend_name, ttt_device):
    inputs = make_inputs(Case(1, 20, 1, 16, 16, F32, final_state=False), ttt_device)
    skip_unless_supported(ttt_backend, inputs, requires_grad=False)
    o, ht, hbt = run_op(ttt_backend_name, inputs)
    expect(ht is None and hbt is None, "final states returned though not requested")
    expect(o.shape == inputs["q"].shape and o.dtype == F32,
           f"o: {o.dtype}{tuple(o.shape)}, expected float32 of q's shape")


def test_partial_chunk_padding_takes_no_part(ttt_backend, ttt_backend_name, ttt_device):
    """T = 20 with chunk 16: the 12 padded positions of the last chunk take no part.
    Appending tokens that are then cut off changes nothing before them, the first chunk
    does not depend on the partial one, and both final states (after 16 and after 20
    tokens) are the oracle's, which leaves padded positions out."""
    case = Case(1, 20, 2, 32, 16, F32)
    inputs = make_inputs(case, ttt_device, seed=61)
    skip_unless_supported(ttt_backend, inputs, requires_grad=False)
    longer = make_inputs(Case(1, 32, 2, 32, 16, F32), ttt_device, seed=62)
    for name in ("q", "k", "v", "eta"):
        longer[name][:, :20] = inputs[name]
    for name in ("w", "b", *STATE_NAMES):
        longer[name] = inputs[name]
    o, ht, hbt = run_op(ttt_backend_name, inputs)
    o_long, _, _ = run_op(ttt_backend_name, longer)
    expect_close("o (first 20 tokens)", o, o_long[:, :20], 1e-6)
    first = {**inputs, **{n: inputs[n][:, :16] for n in ("q", "k", "v", "eta")}}
    o16, ht16, hbt16 = run_op(ttt_backend_name, first)
    expect_close("o (first chunk)", o[:, :16], o16, 1e-6)
    tol = TOLERANCES[F32][0]
    labels = [f"{name} after {t} tokens" for t in (20, 16)
              for name in ("o", "final_state", "final_state_bias")]
    for label, got, want in zip(labels, (o, ht, hbt, o16, ht16, hbt16),
                                (*oracle_forward(inputs), *oracle_forward(first))):
        expect_close(label, got, want, tol)


WHOLE_DEVICE_GIB = 60
"""What ``test_more_than_2_31_elements`` may hold at its peak (its inputs, outputs, saved
tensors and gradients, twice over for the call on the last element), in GiB."""


@pytest.fixture
def device_memory_released(ttt_device):
    """Hands the test's cached device memory back when it ends, so that later tests in the
    same process find the device as it was."""
    yield
    if ttt_device.type == "cuda":
        torch.cuda.empty_cache()


@pytest.mark.big
@pytest.mark.whole_device
def test_more_than_2_31_elements(ttt_backend, ttt_backend_name, ttt_device,
                                 device_memory_released):
    """64-bit offsets: the last batch element of a [64, 2080, 256, 64] bf16 input lies past
    2**31 elements; its outputs and gradients must equal those of the element run alone.
    Needs a device of at least ``WHOLE_DEVICE_GIB`` GiB; on one, memory that other processes
    hold is a failure, not a skip: run it alone (``-m whole_device``, no xdist workers)."""
    B, T, H, D = 64, 2080, 256, 64
    expect(B * T * H * D > 2**31, "the case must exceed 2**31 elements")
    if ttt_device.type != "cuda":
        pytest.skip(f"needs a CUDA device of at least {WHOLE_DEVICE_GIB} GiB (big case)")
    if ttt_backend_name == "reference":
        pytest.skip("reference: plain PyTorch indexing, and its autograd graph at this size "
                    "needs about 90 GiB")
    free, total = torch.cuda.mem_get_info(ttt_device)
    if total < WHOLE_DEVICE_GIB * 2**30:
        pytest.skip(f"needs a device of at least {WHOLE_DEVICE_GIB} GiB, this one has "
                    f"{total / 2**30:.0f} GiB")
    expect(free >= 0.9 * WHOLE_DEVICE_GIB * 2**30,
           f"{free / 2**30:.0f} GiB of {total / 2**30:.0f} GiB free: other processes hold the "
           f"rest; run whole_device tests alone (-m whole_device, no xdist workers)")
    dtype = BF16
    g = torch.Generator(device=ttt_device).manual_seed(71)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=ttt_device, dtype=dtype)

    inputs = dict(q=randn(B, T, H, D), k=torch.nn.functional.normalize(randn(B, T, H, D), dim=-1),
                  v=randn(B, T, H, D), w=1 + 0.1 * randn(H, D), b=0.1 * randn(H, D),
                  eta=0.1 * torch.rand(B, T, H, 1, generator=g, device=ttt_device, dtype=dtype),
                  chunk_size=16)
    skip_unless_supported(ttt_backend, inputs)
    leaves = {n: inputs[n].requires_grad_(True) for n in ("q", "k", "v", "eta")}
    o, _, _ = run_op(ttt_backend_name, inputs)
    do = randn(B, T, H, D)
    dq, dk, dv, deta = torch.autograd.grad(o, list(leaves.values()), do)
    last = {n: inputs[n][-1:].detach().clone().requires_grad_(True) for n in leaves}
    o_last, _, _ = run_op(ttt_backend_name, {**inputs, **last})
    grads_last = torch.autograd.grad(o_last, list(last.values()), do[-1:])
    out_tol, grad_tol = TOLERANCES[dtype]
    expect_close("o of the last batch element", o[-1:], o_last, out_tol)
    for name, full, alone in zip(("q", "k", "v", "eta"), (dq, dk, dv, deta), grads_last):
        expect_close(f"d{name} of the last batch element", full[-1:], alone, grad_tol)
