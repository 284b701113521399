"""``ttt.nn.TTTLinear`` end to end on the backend under test: what a model built on the layer
does with it. A small model (input projection, two TTT-Linear layers, output projection) is
compiled, trained under autocast, captured in a CUDA graph and decoded token by token; each
against the same model in eager float32. Backends that do not take the layer's calls
(``eta_key`` and ``output="query_residual"``) skip with their declared reasons.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ttt
from ttt.nn import TTTCache, TTTLinear

from ..tolerances import TOLERANCES
from .calls import skip_unless_supported
from .cases import BF16, F32
from .compare import expect, expect_close, rel_error

WIDTH, HEADS, MINI_BATCH = 64, 2, 16


class TinyModel(nn.Module):
    """x [B, T, width] -> [B, T, width]: a projection, two TTT-Linear layers (the second
    gated) with residuals, a projection."""

    def __init__(self, backend: str, width: int = WIDTH, heads: int = HEADS,
                 mini_batch: int = MINI_BATCH, layer: type = TTTLinear) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(layer(width, heads, mini_batch, use_gate=use_gate,
                                          backend=backend)
                                    for use_gate in (False, True))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cache: TTTCache | None = None) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h, cache=cache)
        return self.out(h)


def _model(backend_name: str, device, seed: int = 0, layer: type = TTTLinear) -> TinyModel:
    """Every parameter off its initial value (zeros and ones would hide faults)."""
    torch.manual_seed(seed)
    model = TinyModel(backend_name, layer=layer).to(device)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def _inputs(device, B=2, T=40, seed=1) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(B, T, WIDTH, generator=g).to(device)


def _skip_unless_layer_runs(backend, device, dtype=F32) -> None:
    """Skip with the backend's reasons for the layer's operator calls."""
    g = torch.Generator(device="cpu").manual_seed(0)
    D = WIDTH // HEADS

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    skip_unless_supported(backend, dict(
        q=randn(2, 8, HEADS, D), k=randn(2, 8, HEADS, D), v=randn(2, 8, HEADS, D),
        w=randn(HEADS, D).float(), b=randn(HEADS, D).float(),
        eta=randn(2, 8, HEADS, 1).float().abs(), eta_key=randn(2, 8, HEADS, 1).float().abs(),
        initial_state=randn(2, HEADS, D, D).float(),
        initial_state_bias=randn(2, HEADS, 1, D).float(), scale=1.0,
        chunk_size=MINI_BATCH, output="query_residual"))


def _loss(model, x) -> torch.Tensor:
    return model(x).float().square().mean()


def _grads(model, x) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = _loss(model, x)
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.detach().clone()
                           for n, p in model.named_parameters()}


def test_layer_compiled_equals_eager(ttt_backend, ttt_backend_name, ttt_device):
    """``torch.compile(fullgraph=True)`` of the model: the loss and every parameter gradient
    equal eager's within float32's bounds. Inductor on CUDA; on other devices dynamo and AOT
    autograd without code generation (``aot_eager``: inductor's CPU code generation of the
    projections would only test inductor, at a minute's cost)."""
    _skip_unless_layer_runs(ttt_backend, ttt_device)
    torch._dynamo.reset()
    model = _model(ttt_backend_name, ttt_device)
    x = _inputs(ttt_device)
    eager_loss, eager_grads = _grads(model, x)
    compiled = torch.compile(model, fullgraph=True,
                             backend="inductor" if ttt_device.type == "cuda" else "aot_eager")
    loss, grads = _grads(compiled, x)
    out_tol, grad_tol = TOLERANCES[F32]
    expect_close("loss (compiled)", loss, eager_loss, out_tol)
    for name, grad in eager_grads.items():
        expect_close(f"d{name} (compiled)", grads[name], grad, grad_tol)


def test_layer_bf16_autocast_training_steps(ttt_backend, ttt_backend_name, ttt_device):
    """Three SGD steps under bfloat16 autocast against the same steps in float32: each
    step's loss within bfloat16's output bound, the first step's gradients within its
    gradient bound, every gradient float32 and finite."""
    _skip_unless_layer_runs(ttt_backend, ttt_device, BF16)
    reference = _model(ttt_backend_name, ttt_device)
    mixed = copy.deepcopy(reference)
    steps = [_inputs(ttt_device, seed=10 + i) for i in range(3)]
    out_tol, grad_tol = TOLERANCES[BF16]
    for i, x in enumerate(steps):
        want_loss, want_grads = _grads(reference, x)
        with torch.autocast(ttt_device.type, dtype=torch.bfloat16):
            mixed.zero_grad(set_to_none=True)
            loss = _loss(mixed, x)
        loss.backward()
        expect_close(f"loss of step {i} (bf16 autocast)", loss.detach(), want_loss, out_tol)
        for name, param in mixed.named_parameters():
            grad = param.grad
            expect(grad is not None and grad.dtype == torch.float32
                   and bool(torch.isfinite(grad).all()),
                   f"d{name} of step {i}: missing, not float32 or not finite")
            if i == 0:
                expect_close(f"d{name} of step 0 (bf16 autocast)", grad, want_grads[name],
                             grad_tol)
        with torch.no_grad():
            for model in (reference, mixed):
                for param in model.parameters():
                    param -= 0.1 * param.grad


def test_layer_cuda_graph_training_step(ttt_backend, ttt_backend_name, ttt_device):
    """A training step (forward, backward, SGD update) captured in a CUDA graph and replayed
    on three new batches gives eager's losses and parameters (bitwise for deterministic
    backends)."""
    if ttt_device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    _skip_unless_layer_runs(ttt_backend, ttt_device)
    check_cuda_graph_training_step(_model(ttt_backend_name, ttt_device), ttt_backend,
                                   ttt_device)


def check_cuda_graph_training_step(eager, backend, device) -> None:
    """A model's training step in a CUDA graph, replayed, against eager (the test above)."""
    ttt_backend, ttt_device = backend, device
    graphed = copy.deepcopy(eager)
    batches = [_inputs(ttt_device, seed=20 + i) for i in range(3)]
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    graphed_opt = torch.optim.SGD(graphed.parameters(), lr=0.1)

    def step(model, opt, x):
        opt.zero_grad(set_to_none=False)
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        return loss

    static_x = batches[0].clone()
    snapshot = copy.deepcopy(graphed.state_dict())
    side = torch.cuda.Stream(ttt_device)
    side.wait_stream(torch.cuda.current_stream(ttt_device))
    with torch.cuda.stream(side):              # warm-up: kernels compiled, buffers made
        for _ in range(2):
            step(graphed, graphed_opt, static_x)
    torch.cuda.current_stream(ttt_device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(graphed, graphed_opt, static_x)
    graphed.load_state_dict(snapshot)          # back to the eager model's parameters
    bitwise = ttt_backend.capabilities.deterministic
    out_tol, grad_tol = TOLERANCES[F32]
    for i, x in enumerate(batches):
        want = step(eager, eager_opt, x).detach()
        static_x.copy_(x)
        graph.replay()
        got = static_loss.detach().clone()
        if bitwise:
            expect(torch.equal(got, want), f"loss of replay {i}: not bitwise eager's")
        else:
            expect_close(f"loss of replay {i}", got, want, out_tol)
    for (name, p_got), p_want in zip(graphed.named_parameters(), eager.parameters()):
        if bitwise:
            expect(torch.equal(p_got, p_want), f"{name} after 3 replays: not bitwise eager's")
        else:
            expect_close(f"{name} after 3 replays", p_got, p_want, grad_tol)


@torch.no_grad()
def test_layer_generation_cache(ttt_backend, ttt_backend_name, ttt_device):
    """Prefill of 21 tokens, then 19 tokens one at a time through a TTTCache, equals one
    forward over the 40 tokens (float32 bounds)."""
    _skip_unless_layer_runs(ttt_backend, ttt_device)
    check_generation_cache(_model(ttt_backend_name, ttt_device), ttt_device)


def check_generation_cache(model, device, T: int = 40, prefill: int = 21) -> None:
    """Prefill then one-token steps through a TTTCache against one forward over ``T``
    tokens (the test above)."""
    x = _inputs(device, T=T)
    want = model(x)
    cache = TTTCache()
    pieces = [model(x[:, :prefill], cache=cache)]
    pieces += [model(x[:, t:t + 1], cache=cache) for t in range(prefill, x.shape[1])]
    got = torch.cat(pieces, dim=1)
    expect(cache.seen_tokens == x.shape[1], f"cache saw {cache.seen_tokens} tokens")
    out_tol, _ = TOLERANCES[F32]
    error = rel_error(got, want)
    expect(error <= out_tol, f"prefill + decode against one forward: relative error "
                             f"{error:.2e} > {out_tol:.0e}")


def test_layer_backend_is_the_one_under_test(ttt_backend, ttt_backend_name, ttt_device):
    """The layer's calls reach the backend under test (not a fallback)."""
    _skip_unless_layer_runs(ttt_backend, ttt_device)
    layer = TTTLinear(WIDTH, HEADS, MINI_BATCH, backend=ttt_backend_name).to(ttt_device)
    x = _inputs(ttt_device)
    seen = []
    original = ttt_backend.forward

    def spy(problem, needs_backward):
        seen.append(problem.output)
        return original(problem, needs_backward)

    ttt_backend.forward = spy
    try:
        with torch.no_grad():
            layer(x)
    finally:
        del ttt_backend.forward
    expect(seen == ["query_residual"], f"the backend saw calls {seen}")
    expect(ttt.load_backend(ttt_backend_name) is ttt_backend, "another backend object")
