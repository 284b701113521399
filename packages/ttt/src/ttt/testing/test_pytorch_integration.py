"""The op inside PyTorch's machinery, for the backend under test: ``torch.library.opcheck``
of the custom ops, ``torch.compile(fullgraph=True)`` against eager, autocast, and CUDA
graph capture and replay. (The current CUDA stream: ``test_properties``.)

Compiled and captured results are judged against eager by the dtype's relative-error
bound (inductor may order sums differently); replayed graphs and autocast against the
pre-cast call bitwise for backends that declare ``deterministic``, else by that bound.
"""

from __future__ import annotations

import pytest
import torch

import ttt

from ..tolerances import TOLERANCES
from .calls import ThroughTheDispatcher, gradients, op_arguments, run_op, skip_unless_supported
from .cases import (
    BF16,
    F16,
    F32,
    GRAD_INPUTS,
    Case,
    differentiable,
    make_inputs,
    with_requires_grad,
)
from .compare import expect, expect_close

H, D, CHUNK = 2, 16, 16

OPCHECK_CASES = {
    "dense-h0": Case(2, 20, H, D, CHUNK, F32),
    "varlen-h0": Case(1, 27, H, D, CHUNK, F32, seq_lens=(7, 20)),
    "dense-etaF": Case(2, 20, H, D, CHUNK, F32, states=False, eta_tensor=False),
    "varlen-etakey-query_residual": Case(1, 27, H, D, CHUNK, F32, states=False,
                                         seq_lens=(20, 7), eta_key=True,
                                         output="query_residual"),
}


def _inputs(case: Case, device, seed: int = 3) -> dict:
    """The case's inputs, every floating tensor requiring grad."""
    return differentiable(make_inputs(case, device, seed=seed))


def _near(label: str, got: torch.Tensor | None, want: torch.Tensor | None, bound: float,
          bitwise: bool = False) -> None:
    if want is None:
        expect(got is None, f"{label}: expected None")
        return
    expect(got is not None, f"{label}: missing")
    expect(got.dtype == want.dtype and got.shape == want.shape,
           f"{label}: {got.dtype}{tuple(got.shape)}, expected {want.dtype}{tuple(want.shape)}")
    if bitwise:
        expect(torch.equal(got, want), f"{label}: not bitwise equal")
        return
    expect_close(label, got, want, bound)


def _cotangents(outputs, seed: int = 5) -> list:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(x.shape, generator=g).to(device=x.device, dtype=x.dtype)
            for x in outputs]


# --- opcheck -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in OPCHECK_CASES.items()])
def test_opcheck_forward(case, ttt_backend, ttt_backend_name, ttt_device):
    """Schema, fake implementation (shapes of ``saved`` from ``saved_shapes``), autograd
    registration and AOT dispatch of ``ttt::chunk_ttt_linear_fwd``."""
    inputs = _inputs(case, ttt_device)
    skip_unless_supported(ttt_backend, inputs)
    torch.library.opcheck(torch.ops.ttt.chunk_ttt_linear_fwd,
                          op_arguments(ttt_backend_name, inputs))


BACKWARD_CASES = [("dense-h0", True), ("dense-h0", False), ("varlen-h0", True),
                  ("varlen-etakey-query_residual", True)]
"""(case, whether the final states have cotangents)"""


@pytest.mark.parametrize(("name", "final_cotangents"),
                         [pytest.param(n, f, id=f"{n}-{'dht' if f else 'no_dht'}")
                          for n, f in BACKWARD_CASES])
def test_opcheck_backward(name, final_cotangents, ttt_backend, ttt_backend_name, ttt_device):
    """``ttt::chunk_ttt_linear_bwd`` on the forward op's ``saved``: opcheck, no input
    modified, no gradient aliasing an input, one gradient per input asked for."""
    case = OPCHECK_CASES[name]
    inputs = make_inputs(case, ttt_device, seed=4)
    skip_unless_supported(ttt_backend, inputs)
    args = list(op_arguments(ttt_backend_name, inputs))
    args[-1] = True                                          # needs_backward
    o, finals, saved = torch.ops.ttt.chunk_ttt_linear_fwd(*args)
    expect(len(saved) == len(ttt_backend.saved_shapes(ttt.make_problem(**inputs))),
           "saved tensors do not match the backend's saved_shapes")
    do, dht, dhbt = _cotangents([o, *finals])
    if not final_cotangents:
        dht = dhbt = None
    tensors = args[:len(GRAD_INPUTS) + 1]                     # the inputs and cu_seqlens
    eta_is_tensor = case.eta_tensor
    needs = [t is not None and (n != "eta" or eta_is_tensor) for n, t in zip(GRAD_INPUTS, tensors)]
    bwd_args = (do, dht, dhbt, *tensors, saved, *args[len(tensors):-1], needs)
    before = [t.clone() for t in bwd_args if isinstance(t, torch.Tensor)]
    utils = ["test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic"]
    if ttt_backend_name == "reference":
        # the reference backward differentiates its forward with autograd, which
        # test_schema's dispatch mode cannot see into; its check (no input modified, no
        # output aliasing an input) is made below for every backend
        utils.remove("test_schema")
    torch.library.opcheck(torch.ops.ttt.chunk_ttt_linear_bwd, bwd_args, test_utils=utils)
    grads = torch.ops.ttt.chunk_ttt_linear_bwd(*bwd_args)
    after = [t for t in bwd_args if isinstance(t, torch.Tensor)]
    expect(all(torch.equal(a, b) for a, b in zip(before, after)), "an input was modified")
    storages = {t.untyped_storage().data_ptr() for t in after}
    expect(not any(g.untyped_storage().data_ptr() in storages for g in grads),
           "a gradient aliases an input")
    expect(len(grads) == sum(needs), f"{len(grads)} gradients for {sum(needs)} needed")


# --- the eager shortcut and the dispatcher's path ------------------------------------------


@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in OPCHECK_CASES.items()])
def test_eager_shortcut_equals_the_dispatcher_path(case, ttt_backend, ttt_backend_name,
                                                   ttt_device):
    """An eager call takes a shortcut past the dispatcher's generic glue (on every torch
    version the core supports); the same call through the dispatcher gives the same outputs
    and gradients, bitwise for a deterministic backend. Both paths check what the op
    returns for aliasing."""
    inputs = _inputs(case, ttt_device)
    skip_unless_supported(ttt_backend, inputs)

    def fn(x):
        return ttt.chunk_ttt_linear(**x, backend=ttt_backend_name)

    shortcut = _loss_and_grads(fn, inputs)
    with ThroughTheDispatcher():
        dispatched = _loss_and_grads(fn, inputs, shortcut[2])
    _compare_runs("dispatcher path against the eager shortcut", dispatched, shortcut,
                  case.dtype, bitwise=ttt_backend.capabilities.deterministic)


# --- torch.compile -----------------------------------------------------------------------


COMPILE_CASES = {
    "dense-h0": Case(2, 20, H, D, CHUNK, F32),
    "dense-etakey-query_residual": Case(2, 20, H, D, CHUNK, F32, eta_key=True,
                                        output="query_residual"),
}


def _skip_unless_compiles(device: torch.device) -> None:
    """torch.compile needs a working inductor for the device (a C++ compiler on CPU)."""
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001 - any failure means no compiler to use
            pytest.skip(f"torch.compile on CPU: no C++ compiler for inductor ({exc})")


def _loss_and_grads(fn, inputs: dict, cotangents=None):
    outputs = [x for x in fn(inputs) if x is not None]
    cotangents = cotangents or _cotangents(outputs)
    return outputs, gradients(inputs, outputs, cotangents), cotangents


def _compare_runs(label, got, want, dtype, bitwise=False):
    out_tol, grad_tol = TOLERANCES[dtype]
    for i, (a, b) in enumerate(zip(got[0], want[0])):
        _near(f"{label}: output {i}", a, b, out_tol, bitwise)
    for name, grad in want[1].items():
        _near(f"{label}: d{name}", got[1][name], grad, grad_tol, bitwise)


def _assert_compiled_call_equals_eager(label, case, backend, backend_name, device,
                                       **compile_options):
    """``ttt.chunk_ttt_linear`` on ``case``'s inputs, compiled with ``compile_options``:
    outputs, final states and every gradient equal eager's."""
    inputs = _inputs(case, device)
    skip_unless_supported(backend, inputs)
    _skip_unless_compiles(device)
    torch._dynamo.reset()

    def fn(x):
        return ttt.chunk_ttt_linear(**x, backend=backend_name)

    eager = _loss_and_grads(fn, inputs)
    got = _loss_and_grads(torch.compile(fn, **compile_options), inputs, eager[2])
    _compare_runs(label, got, eager, case.dtype)


@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in COMPILE_CASES.items()])
def test_compile_fullgraph_function_equals_eager(case, ttt_backend, ttt_backend_name,
                                                 ttt_device):
    """A function calling ``ttt.chunk_ttt_linear`` (dense): compiled with fullgraph=True,
    its outputs, final states and every gradient equal eager's."""
    _assert_compiled_call_equals_eager("compiled function", case, ttt_backend,
                                       ttt_backend_name, ttt_device, fullgraph=True)


class _Layer(torch.nn.Module):
    """A small module around the op: projections, learned states, per-key eta (where the
    backend declares it)."""

    def __init__(self, output: str, backend: str, eta_key: bool):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.proj = torch.nn.Linear(H * D, 3 * H * D + 2 * H)
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(H, D, generator=gen))
        self.b = torch.nn.Parameter(0.1 * torch.randn(H, D, generator=gen))
        self.h0 = torch.nn.Parameter(0.3 * torch.randn(1, H, D, D, generator=gen))
        self.output, self.backend, self.eta_key = output, backend, eta_key

    def forward(self, x: torch.Tensor):
        B, T, _ = x.shape
        qkv, gates = self.proj(x).split([3 * H * D, 2 * H], dim=-1)
        q, k, v = qkv.reshape(B, T, 3, H, D).unbind(2)
        eta = 0.1 * torch.sigmoid(gates[..., :H]).unsqueeze(-1)
        eta_key = torch.sigmoid(gates[..., H:]).unsqueeze(-1) if self.eta_key else None
        o, ht, _ = ttt.chunk_ttt_linear(
            q, torch.nn.functional.normalize(k, dim=-1), v, self.w, self.b, eta,
            chunk_size=CHUNK, initial_state=self.h0.expand(B, -1, -1, -1).contiguous(),
            output_final_state=True, eta_key=eta_key, output=self.output,
            backend=self.backend)
        return o.reshape(B, T, H * D), ht


@pytest.mark.parametrize("output", ["norm_residual", "raw"])   # query_residual: above
def test_compile_fullgraph_module_equals_eager(output, ttt_backend, ttt_backend_name,
                                               ttt_device):
    """An nn.Module around the op (eta_key from a gate where declared; the function above
    takes query_residual): compiled with fullgraph=True, outputs and the gradients of its
    input and parameters equal eager's."""
    torch.manual_seed(0)
    layer = _Layer(output, ttt_backend_name, ttt_backend.capabilities.eta_key).to(ttt_device)
    x = torch.randn(2, 20, H * D, generator=torch.Generator().manual_seed(4))
    x = x.to(ttt_device).requires_grad_(True)
    probe = make_inputs(Case(2, 20, H, D, CHUNK, F32, eta_key=layer.eta_key, output=output),
                        ttt_device)
    skip_unless_supported(ttt_backend, differentiable(probe))
    _skip_unless_compiles(ttt_device)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)

    def run(module):
        o, ht = module(x)
        weights = torch.linspace(-1, 1, o.shape[-1], device=ttt_device)
        loss = (o * weights).sum() + ht.square().sum()
        params = [x, *layer.parameters()]
        return [o, ht], dict(enumerate(torch.autograd.grad(loss, params)))

    _compare_runs("compiled module", run(compiled), run(layer), F32)


def test_compile_dynamic_lengths_equal_eager(ttt_backend, ttt_backend_name, ttt_device):
    """dynamic=True: one graph for several batch sizes and lengths (partial chunks)."""
    cases = [Case(1, 20, H, D, CHUNK, F32), Case(2, 37, H, D, CHUNK, F32)]
    skip_unless_supported(ttt_backend, _inputs(cases[0], ttt_device))
    _skip_unless_compiles(ttt_device)
    torch._dynamo.reset()

    def fn(x):   # the options as literals: dynamic=True makes ints it reads from a dict symbolic
        tensors = {n: t for n, t in x.items() if isinstance(t, torch.Tensor)}
        return ttt.chunk_ttt_linear(**tensors, chunk_size=CHUNK, output_final_state=True,
                                    backend=ttt_backend_name)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for case in cases:
        inputs = _inputs(case, ttt_device, seed=case.T)
        eager = _loss_and_grads(fn, inputs)
        got = _loss_and_grads(compiled, inputs, eager[2])
        _compare_runs(f"compiled (dynamic) B={case.B} T={case.T}", got, eager, F32)


def test_compile_varlen_with_a_graph_break_equals_eager(ttt_backend, ttt_backend_name,
                                                        ttt_device):
    """A tensor ``cu_seqlens`` is read on the host: dynamo breaks the graph there, and the
    rest runs through the op; outputs and gradients equal eager's."""
    case = Case(1, 27, H, D, CHUNK, F32, seq_lens=(7, 20))
    _assert_compiled_call_equals_eager("compiled varlen", case, ttt_backend, ttt_backend_name,
                                       ttt_device)


# --- autocast ----------------------------------------------------------------------------


def _autocast_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CPU (the dtype CPU autocast supports), float16 on CUDA (its default)."""
    return BF16 if device.type == "cpu" else F16


@pytest.mark.parametrize("seq_lens", [None, (7, 30)], ids=["dense", "varlen"])
def test_autocast_casts_q_k_v_only(seq_lens, ttt_backend, ttt_backend_name, ttt_device):
    """In an autocast region of the test device's type, q, k, v go in cast to its dtype,
    eta, eta_key (where declared), w, b and the initial states keep theirs: outputs, final
    states and every gradient are those of a call with q, k, v cast beforehand (the
    gradients of q, k, v in their own dtype, float32)."""
    dtype = _autocast_dtype(ttt_device)
    B = 1 if seq_lens else 2
    case = Case(B, 37, H, D, CHUNK, F32, seq_lens=seq_lens,
                eta_key=ttt_backend.capabilities.eta_key)
    inputs = _inputs(case, ttt_device)
    precast = dict(inputs)
    for name in ("q", "k", "v"):
        precast[name] = inputs[name].detach().to(dtype).requires_grad_(True)
    skip_unless_supported(ttt_backend, precast)
    with torch.autocast(ttt_device.type, dtype=dtype):
        out = run_op(ttt_backend_name, inputs)
    want = run_op(ttt_backend_name, precast)
    expect(out[0].dtype == dtype, f"o: {out[0].dtype} under autocast to {dtype}")
    cotangents = _cotangents(want)
    grads = gradients(inputs, list(out), cotangents)
    want_grads = gradients(precast, list(want), cotangents)
    for name in ("q", "k", "v"):
        expect(grads[name].dtype == F32, f"d{name}: {grads[name].dtype}, q, k, v are float32")
        want_grads[name] = want_grads[name].to(F32)
    bitwise = ttt_backend.capabilities.deterministic
    _compare_runs("autocast", (out, grads), (want, want_grads), dtype, bitwise)


# --- CUDA graphs -------------------------------------------------------------------------


def _capture(step, device):
    """``step()`` warmed up on a side stream, then captured in a CUDA graph."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    return graph, static_out


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_cuda_graph_replay_equals_eager(dtype, backward, ttt_backend, ttt_backend_name,
                                        ttt_device):
    """Dense calls captured in a CUDA graph (the forward; the forward and the gradients of
    every input): replayed on new inputs copied into the captured ones, the results equal
    an eager call on those inputs."""
    if ttt_device.type != "cuda":
        pytest.skip(f"CUDA graphs: needs a CUDA device (test device: {ttt_device})")
    case = Case(2, 70, H, 32, CHUNK, dtype, eta_key=ttt_backend.capabilities.eta_key)
    static = with_requires_grad(make_inputs(case, ttt_device, seed=1),
                                GRAD_INPUTS if backward else ())
    skip_unless_supported(ttt_backend, static, requires_grad=backward)
    fresh = with_requires_grad(make_inputs(case, ttt_device, seed=2),
                               GRAD_INPUTS if backward else ())
    cotangents = _cotangents(run_op(ttt_backend_name, fresh))

    def step():
        outputs = list(run_op(ttt_backend_name, static))
        grads = gradients(static, outputs, cotangents) if backward else {}
        return outputs, grads

    graph, (outputs, grads) = _capture(step, ttt_device)
    with torch.no_grad():
        for name, t in fresh.items():
            if isinstance(t, torch.Tensor):
                static[name].copy_(t)
    graph.replay()
    torch.cuda.synchronize(ttt_device)
    want = list(run_op(ttt_backend_name, fresh))
    want_grads = gradients(fresh, want, cotangents) if backward else {}
    bitwise = ttt_backend.capabilities.deterministic
    _compare_runs("CUDA graph replay", (outputs, grads), (want, want_grads), dtype, bitwise)
