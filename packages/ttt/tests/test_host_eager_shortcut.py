"""The eager shortcut around the custom op's dispatch (``ttt._custom_op.forward`` /
``backward``): a plain eager call skips the op, anything that may watch or transform the
op gets it, and both give bitwise the same outputs, gradients and errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ttt
from ttt import _custom_op

H, D, CHUNK = 2, 8, 16


class _PassThrough(TorchDispatchMode):
    """Changes nothing; its presence makes every call take the op (backward included)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _inputs(varlen: bool, tensor_eta: bool, eta_key: bool, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B, T, cu = (1, 40, torch.tensor([0, 9, 40])) if varlen else (2, 21, None)
    N = 2
    x = dict(q=torch.randn(B, T, H, D, generator=gen),
             k=torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1),
             v=torch.randn(B, T, H, D, generator=gen),
             w=1 + 0.2 * torch.randn(H, D, generator=gen),
             b=0.2 * torch.randn(H, D, generator=gen),
             eta=0.05 + 0.1 * torch.rand(B, T, H, 1, generator=gen) if tensor_eta else 0.1,
             eta_key=0.5 + torch.rand(B, T, H, 1, generator=gen) if eta_key else None,
             initial_state=0.3 * torch.randn(N, H, D, D, generator=gen),
             initial_state_bias=0.3 * torch.randn(N, H, 1, D, generator=gen))
    for t in x.values():
        if isinstance(t, torch.Tensor):
            t.requires_grad_(True)
    return dict(x, cu_seqlens=cu)


def _run(x: dict, used: tuple[int, ...]):
    out = ttt.chunk_ttt_linear(
        x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"], chunk_size=CHUNK,
        initial_state=x["initial_state"], initial_state_bias=x["initial_state_bias"],
        output_final_state=True, cu_seqlens=x["cu_seqlens"], eta_key=x["eta_key"],
        backend="reference")
    leaves = [t for t in x.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    gen = torch.Generator().manual_seed(7)
    cotangents = [torch.randn(out[i].shape, generator=gen) for i in used]
    grads = torch.autograd.grad([out[i] for i in used], leaves, cotangents)
    return [t.detach() for t in out], list(grads)


def _count_op_calls(monkeypatch) -> dict:
    calls = {"fwd": 0, "bwd": 0}

    def counted(name, op):
        def call(*args):
            calls[name] += 1
            return op(*args)
        return call

    monkeypatch.setattr(_custom_op, "chunk_ttt_linear_fwd",
                        counted("fwd", _custom_op.chunk_ttt_linear_fwd))
    monkeypatch.setattr(_custom_op, "chunk_ttt_linear_bwd",
                        counted("bwd", _custom_op.chunk_ttt_linear_bwd))
    return calls


needs_shortcut = pytest.mark.skipif(
    not _custom_op.SHORTCUT_AVAILABLE,
    reason="this torch lacks the private APIs of the eager shortcut: every call takes the op")


@needs_shortcut
@pytest.mark.parametrize("used", [(0, 1, 2), (0,), (1,)], ids=["all", "o", "state"])
@pytest.mark.parametrize("varlen, tensor_eta, eta_key",
                         [(False, True, False), (True, True, True), (False, False, True)],
                         ids=["dense", "varlen_eta_key", "float_eta"])
def test_shortcut_equals_the_op_bitwise(varlen, tensor_eta, eta_key, used, monkeypatch):
    calls = _count_op_calls(monkeypatch)
    x = _inputs(varlen, tensor_eta, eta_key)
    fast = _run(x, used)
    assert calls == {"fwd": 0, "bwd": 0}                   # the shortcut ran
    with _PassThrough():
        slow = _run(x, used)
    assert calls == {"fwd": 1, "bwd": 1}                   # the op ran
    for got, want in zip([*fast[0], *fast[1]], [*slow[0], *slow[1]]):
        assert got.dtype == want.dtype and torch.equal(got, want)


@needs_shortcut
def test_no_grad_call_skips_the_op_and_records_nothing(monkeypatch):
    calls = _count_op_calls(monkeypatch)
    x = _inputs(False, True, False)
    with torch.no_grad():
        o, ht, hbt = ttt.chunk_ttt_linear(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"],
                                          output_final_state=True, backend="reference")
    assert calls["fwd"] == 0
    assert o.grad_fn is None and not o.requires_grad and ht.grad_fn is None


def test_dispatch_mode_and_profiler_take_the_op(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    calls = _count_op_calls(monkeypatch)
    x = _inputs(False, True, False)
    args = (x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"])
    with FlopCounterMode(display=False):
        ttt.chunk_ttt_linear(*args, backend="reference")
    assert calls["fwd"] == 1
    with torch.profiler.profile() as prof:
        ttt.chunk_ttt_linear(*args, backend="reference")
    assert calls["fwd"] == 2
    assert any("chunk_ttt_linear_fwd" in e.key for e in prof.key_averages())


class _AliasingBackend(ttt.Backend):
    """Breaks the contract: returns its input q as the output."""

    name = "aliasing"
    capabilities = ttt.Capabilities(devices=frozenset({"cpu"}),
                                    dtypes=frozenset({torch.float32}))

    def forward(self, problem, needs_backward):
        return problem.q, None, None, []


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("through_op", [False, True])
def test_an_output_aliasing_an_input_is_refused_on_both_paths(requires_grad, through_op,
                                                              register):
    register("aliasing", _AliasingBackend())
    x = _inputs(False, True, False)
    args = [x[n].detach().requires_grad_(requires_grad) for n in ("q", "k", "v", "w", "b", "eta")]
    mode = _PassThrough() if through_op else torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t)
    with mode, pytest.raises(RuntimeError, match="may not alias any inputs"):
        ttt.chunk_ttt_linear(*args, backend="aliasing")


@pytest.mark.parametrize("through_op", [False, True])
def test_double_backward_is_refused_on_both_paths(through_op):
    x = _inputs(False, True, False)
    mode = _PassThrough() if through_op else torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t)
    with mode:
        o, _, _ = ttt.chunk_ttt_linear(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"],
                                       backend="reference")
        (dq,) = torch.autograd.grad(o.square().sum(), [x["q"]], create_graph=True)
        with pytest.raises(RuntimeError, match="autograd"):
            dq.sum().backward()


PRIVATE_APIS = (
    "torch._C._ForceDispatchKeyGuard", "torch._C._dispatch_tls_local_include_set",
    "torch._C._dispatch_tls_local_exclude_set", "torch._C._AutoDispatchBelowAutograd",
    "torch._library.utils._c_check_aliasing_constraint", "torch._C._len_torch_dispatch_stack",
    "torch._C._is_torch_function_mode_enabled", "torch._C._autograd._profiler_enabled",
    "torch._C._get_tracing_state", "torch._C._functorch.peek_interpreter_stack")
"""The private torch APIs of ``ttt._custom_op``: the backward's autograd keys
(``_with_autograd``) and the eager shortcut, which saves most of the core's host time of
a small training step (4,1,16,64 fwd+bwd on a null backend, CPU: 112 us against 327 us
through the op's dispatch)."""


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 7),
                    reason="torch 2.5 and 2.6 lack the shortcut's aliasing check: every "
                           "call takes the op there")
def test_the_private_torch_apis_are_there():
    """Fails, naming it, when a torch release moves one of the private APIs the core uses
    (on such a torch the shortcut would otherwise switch itself off without a word)."""
    missing = []
    for path in PRIVATE_APIS:
        obj = torch
        for part in path.split(".")[1:]:
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(path)
    assert not missing, f"torch {torch.__version__} lacks {missing}"
    assert _custom_op.SHORTCUT_AVAILABLE
