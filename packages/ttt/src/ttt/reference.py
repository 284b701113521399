"""Pure-PyTorch reference backend: any device, float64 included, every feature.

The chunked dual form of docs/math.md per chunk of ``L <= chunk_size`` valid rows, every
(sequence, head) at once; half inputs compute in float32; the backward recomputes the
forward under autograd (memory light).
"""

from __future__ import annotations

import torch

from .arguments import GRADIENT_FIELDS, Gradients
from .backend import Backend, Capabilities, GradNeeds, WarmupShape
from .inner_loss import chunked, layer_norm_l2_grad
from .problem import OUTPUTS, Problem, state_shapes
from .reference_mlp import mlp_forward


def _chunk(state, q, k, v, eta, key, w, b, eps):
    """One chunk of every (sequence, head): q (scaled), k, v [N, H, L, D]; eta, key (or
    None) [N, H, L, 1]; w, b [1, H, 1, D]; state (W [N, H, D, D], hb [N, H, 1, D]).
    Returns z and the next state."""
    W, hb = state
    L = q.shape[2]
    g = layer_norm_l2_grad(k @ W + hb, k, v, w, b, eps)                # [N, H, L, D]
    if key is not None:
        g = g * key
    causal = torch.ones(L, L, dtype=q.dtype, device=q.device).tril()
    z = q @ W + hb - eta * (((q @ k.transpose(-1, -2)) * causal + causal) @ g)
    last = eta[:, :, -1:]                                               # [N, H, 1, 1]
    return z, (W - last * (k.transpose(-1, -2) @ g), hb - last * g.sum(-2, keepdim=True))


def compute(problem: Problem, q, k, v, w, b, eta, h0, hb0, eta_key=None):
    """The whole operator on given tensors (which may require grad)."""
    p = problem
    state = tuple(torch.zeros(shape, dtype=p.state_dtype, device=q.device) if s is None
                  else s for s, shape in zip((h0, hb0), state_shapes(p.N, p.H, p.D)))
    o, (ht, hbt) = chunked(_chunk, q, k, v, w, b, eta, eta_key, state, p.scale, p.eps,
                           p.chunk_size, p.seq_lens if p.is_varlen else None, p.output)
    return (o, ht, hbt) if p.output_final_state else (o, None, None)


class ReferenceBackend(Backend):
    """Plain PyTorch ops, a Python loop over chunks; every device and dtype."""

    name = "reference"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu", "meta"}),
        dtypes=frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16}),
        ops=frozenset({"ttt_linear", "ttt_mlp"}),
        eta_key=True,
        outputs=frozenset(OUTPUTS),
        notes=("pure PyTorch; a Python loop over chunks; backward recomputes the forward",),
    )

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def warmup_shapes(self, heads, head_dim, chunk_size, dtype) -> list[WarmupShape]:
        """Nothing to compile: one short dense and one packed batch check that calls run."""
        return [WarmupShape(1, chunk_size + 1), WarmupShape(2, chunk_size, packed=True)]

    def forward(self, problem: Problem, needs_backward: bool):
        with torch.no_grad():
            o, ht, hbt = compute(problem, problem.q, problem.k, problem.v, problem.w,
                                 problem.b, problem.eta, problem.initial_state,
                                 problem.initial_state_bias, problem.eta_key)
        return o, ht, hbt, []

    def chunk_ttt_mlp(self, problem):
        """TTT-MLP by :func:`ttt.reference_mlp.mlp_forward`, differentiable by autograd."""
        return mlp_forward(problem)

    def backward(self, problem: Problem, saved: list[torch.Tensor], do, dht, dhbt,
                 needs: GradNeeds):
        names = ("q", "k", "v", "w", "b", "eta", "initial_state", "initial_state_bias",
                 "eta_key")
        leaves = {}
        for name in names:
            tensor = getattr(problem, name)
            want = getattr(needs, name) and tensor is not None
            if name == "eta":
                want = want and problem.eta_is_tensor
            leaves[name] = tensor.detach().requires_grad_(want) if tensor is not None else None
        with torch.enable_grad():
            o, ht, hbt = compute(problem, *leaves.values())
            outputs, cotangents = [o], [do]
            for out, cot in ((ht, dht), (hbt, dhbt)):
                if out is not None and cot is not None and out.requires_grad:
                    outputs.append(out)
                    cotangents.append(cot)
            wanted = [name for name in names if leaves[name] is not None
                      and leaves[name].requires_grad]
            grads = torch.autograd.grad(outputs, [leaves[n] for n in wanted], cotangents,
                                        allow_unused=True) if wanted else ()
        return Gradients(**{GRADIENT_FIELDS[name]: grad for name, grad in zip(wanted, grads)})
