"""Calling the backend under test: through the public op, skipping with the backend's own
declared reasons when it does not take the inputs."""

from __future__ import annotations

import pytest
import torch

import ttt

from .cases import GRAD_INPUTS, grad_leaves


def skip_unless_supported(backend: ttt.Backend, inputs: dict, requires_grad: bool = True):
    """Skip with ``backend.not_supported_reasons`` of the public ``ttt.make_problem``."""
    with torch.set_grad_enabled(requires_grad):
        probe = {k: (v.detach().requires_grad_(requires_grad and k in GRAD_INPUTS)
                     if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                 for k, v in inputs.items()}
        problem = ttt.make_problem(**probe)
    reasons = backend.not_supported_reasons(problem)
    if reasons:
        pytest.skip(f"{backend.name} declares: {'; '.join(reasons)}")


class ThroughTheDispatcher(torch.overrides.TorchFunctionMode):
    """A mode that changes nothing; with any mode active, an eager call of an op takes the
    dispatcher's path (the custom op and its registered autograd formula) instead of the
    eager shortcut past it (``ttt._custom_op.eager_and_plain``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def run_op(backend_name: str, inputs: dict):
    return ttt.chunk_ttt_linear(**inputs, backend=backend_name)


def outputs_for_loss(outputs: tuple, cotangents: dict, which: str):
    """The outputs the loss reads and their cotangents: ``o`` ("o"), the final states
    ("states") or all three ("both"; the states only where returned)."""
    o, ht, hbt = outputs
    pairs = []
    if which in ("o", "both"):
        pairs.append((o, cotangents["o"]))
    if which in ("states", "both") and ht is not None:
        pairs += [(ht, cotangents["final_state"]), (hbt, cotangents["final_state_bias"])]
    return [x for x, _ in pairs], [c for _, c in pairs]


def gradients(inputs: dict, outputs: list, cotangents: list) -> dict:
    """Gradients of every input that requires grad (None where autograd gives none)."""
    leaves = grad_leaves(inputs)
    pairs = [(x, c) for x, c in zip(outputs, cotangents) if x.requires_grad]
    if not leaves or not pairs:   # e.g. the final states do not depend on q
        return {name: None for name, _ in leaves}
    grads = torch.autograd.grad([x for x, _ in pairs], [t for _, t in leaves],
                                [c for _, c in pairs], allow_unused=True)
    return dict(zip([n for n, _ in leaves], grads))


def outputs_and_grads(backend_name: str, inputs: dict, seed: int = 7):
    """Outputs and the gradients of every input requiring grad, for random cotangents on
    every returned output."""
    out = run_op(backend_name, inputs)
    outputs = [x for x in out if x is not None]
    g = torch.Generator(device="cpu").manual_seed(seed)
    cots = [torch.randn(x.shape, generator=g).to(device=x.device, dtype=x.dtype)
            for x in outputs]
    return outputs, gradients(inputs, outputs, cots)


def op_arguments(backend_name: str, inputs: dict) -> tuple:
    """The arguments of ``torch.ops.ttt.chunk_ttt_linear_fwd`` as ``ttt.chunk_ttt_linear``
    builds them for these inputs on backend ``backend_name`` (the validated
    ``ttt.make_problem`` laid out by ``ttt._custom_op.arguments``, the op's schema order)."""
    from ttt import _custom_op

    return _custom_op.arguments(ttt.make_problem(**inputs), backend_name)
