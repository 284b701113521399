"""The float64 oracle's answer for a case, computed once per test process and shared by
every test of the case.

The cotangents are drawn in float64, rounded to the dtypes of the outputs they belong to
(``o``: the input dtype; final states: float32, float64 for float64 inputs), and the oracle
gets those rounded values upcast: backend and oracle differentiate the same loss.

Gradients are linear in the cotangents and do not depend on which inputs require grad, so
one oracle backward per cotangent (``o``; the two final states) serves every variant of a
case: the loss through ``o`` only, the final states only, both, and any subset of inputs
that require grad.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..oracle import oracle_chunk_ttt_linear
from .cases import GRAD_INPUTS, Case, make_inputs

F64 = torch.float64
OUTPUT_NAMES = ("o", "final_state", "final_state_bias")


@dataclass(frozen=True)
class Expected:
    case: Case
    inputs: dict                           # the case's inputs, rounded, on the test device
    outputs: dict[str, torch.Tensor]       # float64 o, final_state, final_state_bias
    cotangents: dict[str, torch.Tensor]    # rounded to each output's dtype
    grads_through_o: dict[str, torch.Tensor]
    grads_through_states: dict[str, torch.Tensor]   # empty without final states

    def grads(self, cotangents: str) -> dict[str, torch.Tensor]:
        """float64 gradients of every differentiable input for the loss through ``o``
        ("o"), the final states ("states") or both ("both")."""
        if cotangents == "o":
            return self.grads_through_o
        if cotangents == "states":
            return self.grads_through_states
        return {n: g + self.grads_through_states[n] if self.grads_through_states else g
                for n, g in self.grads_through_o.items()}


def oracle_inputs(inputs: dict, requires_grad: bool) -> dict:
    """float64 copies of the (already rounded) inputs, as the oracle's arguments."""
    args = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().to(F64).requires_grad_(requires_grad and name in GRAD_INPUTS)
        args[name] = value
    args.pop("output_final_state", None)
    return args


def oracle_forward(inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return oracle_chunk_ttt_linear(**oracle_inputs(inputs, requires_grad=False))


def _grads(outputs, leaves: dict, cotangents) -> dict[str, torch.Tensor]:
    pairs = [(x, c) for x, c in zip(outputs, cotangents) if x.requires_grad]
    if not pairs:                 # (empty sequences: outputs that depend on no input)
        return {name: torch.zeros_like(leaf) for name, leaf in leaves.items()}
    grads = torch.autograd.grad([x for x, _ in pairs], list(leaves.values()),
                                [c for _, c in pairs], retain_graph=True, allow_unused=True)
    return {name: torch.zeros_like(leaf) if g is None else g.detach()
            for (name, leaf), g in zip(leaves.items(), grads)}


@functools.lru_cache(maxsize=4)
def expected_for(case: Case, device: str) -> Expected:
    """The oracle's outputs and gradients for ``case`` (cached: the variants of a case run
    one after another in one worker)."""
    inputs = make_inputs(case, device, seed=case.seed)
    args = oracle_inputs(inputs, requires_grad=True)
    leaves = {n: args[n] for n in GRAD_INPUTS
              if isinstance(args.get(n), torch.Tensor) and args[n].requires_grad}
    with torch.enable_grad():
        o, ht, hbt = oracle_chunk_ttt_linear(**args)
        g = torch.Generator(device="cpu").manual_seed(case.seed + 1)
        dtypes = (case.dtype, case.state_dtype, case.state_dtype)
        cotangents = {name: torch.randn(x.shape, generator=g, dtype=F64).to(dt).to(device)
                      for name, x, dt in zip(OUTPUT_NAMES, (o, ht, hbt), dtypes)}
        through_o = _grads([o], leaves, [cotangents["o"].to(F64)])
        through_states = _grads(
            [ht, hbt], leaves,
            [cotangents["final_state"].to(F64), cotangents["final_state_bias"].to(F64)]
        ) if case.final_state else {}
    outputs = dict(zip(OUTPUT_NAMES, (o.detach(), ht.detach(), hbt.detach())))
    return Expected(case, inputs, outputs, cotangents, through_o, through_states)
