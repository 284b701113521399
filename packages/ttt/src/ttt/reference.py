r"""Pure-PyTorch reference backend: any device, float64 included, every feature.

Per (sequence, head), with state ``W [D, D]`` and bias state ``hb [D]`` (from the initial
states, else zero), each chunk of ``L <= chunk_size`` *valid* rows (q scaled by ``scale``):

.. math::

    \hat x &= \mathrm{LN}(k W + hb)                      \quad (\text{no affine, eps})\\
    y &= (\hat x \odot w + b - (v - k)) \odot w          \quad (= \partial \ell / \partial \hat x)\\
    g &= l \odot \mathrm{rstd}\,(y - \overline{y} - \hat x\,\overline{y \hat x})
         \quad (= l\, \partial \ell / \partial (kW+hb))\\
    z &= q W + hb - \eta \odot \big((\mathrm{tril}(q k^\top) + \mathrm{tril}(1))\, g\big)\\
    W &\leftarrow W - \eta_{last}\, k^\top g, \qquad
    hb \leftarrow hb - \eta_{last} \textstyle\sum_i g_i

with ``l`` the per-key factor ``eta_key`` (1 when None), then the output form:
``z + LN(z) * w + b``, ``q + LN(z) * w + b`` (q unscaled) or ``z``. Half inputs compute in
float32; the backward recomputes the forward under autograd (memory light).
"""

from __future__ import annotations

import torch

from .arguments import GRADIENT_FIELDS, Gradients
from .backend import Backend, Capabilities, GradNeeds, WarmupShape
from .inner_loss import layer_norm_l2_grad, output_form
from .problem import OUTPUTS, Problem
from .reference_mlp import mlp_forward


def _sequence_forward(q, k, v, eta, eta_key, w, b, h0, hb0, scale, eps, chunk_size):
    """Equal-length sequences: q, k, v [B, H, T, D]; eta, eta_key (or None) [B, H, T, 1];
    w, b [1, H, 1, D]; h0 [B, H, D, D]; hb0 [B, H, 1, D]. Returns z and the states."""
    T = q.shape[2]
    state, state_bias = h0, hb0
    outputs = []
    for start in range(0, T, chunk_size):
        stop = min(start + chunk_size, T)
        b_q = q[:, :, start:stop] * scale                    # [B, H, L, D], as k and v
        b_k, b_v = k[:, :, start:stop], v[:, :, start:stop]
        b_e = eta[:, :, start:stop]                          # [B, H, L, 1]
        length = stop - start

        b_g = layer_norm_l2_grad(b_k @ state + state_bias, b_k, b_v, w, b, eps)   # [B, H, L, D]
        if eta_key is not None:
            b_g = b_g * eta_key[:, :, start:stop]            # [B, H, L, D]

        causal = torch.ones(length, length, dtype=q.dtype, device=q.device).tril()
        b_A = (b_q @ b_k.transpose(-1, -2)) * causal + causal   # [B, H, L, L]
        outputs.append(b_q @ state + state_bias - b_e * (b_A @ b_g))

        b_e_last = b_e[:, :, -1:]                            # [B, H, 1, 1]
        state = state - b_e_last * (b_k.transpose(-1, -2) @ b_g)
        state_bias = state_bias - b_e_last * b_g.sum(-2, keepdim=True)
    o = torch.cat(outputs, dim=2) if outputs else q.new_zeros(q.shape)
    return o, state, state_bias


def compute(problem: Problem, q, k, v, w, b, eta, h0, hb0, eta_key=None):
    """The whole operator on given tensors (which may require grad)."""
    cdt = problem.state_dtype
    B, T, H, D = q.shape
    N = problem.N
    q, k, v, eta = (t.to(cdt).transpose(1, 2) for t in (q, k, v, eta))   # [B, H, T, D or 1]
    if eta_key is not None:
        eta_key = eta_key.to(cdt).transpose(1, 2)              # [B, H, T, 1]
    w4, b4 = (t.to(cdt).reshape(1, H, 1, D) for t in (w, b))
    h0 = q.new_zeros(N, H, D, D) if h0 is None else h0.to(cdt)
    hb0 = q.new_zeros(N, H, 1, D) if hb0 is None else hb0.to(cdt)
    args = (problem.scale, problem.eps, problem.chunk_size)

    if problem.cu_seqlens is None:
        o, ht, hbt = _sequence_forward(q, k, v, eta, eta_key, w4, b4, h0, hb0, *args)
    else:
        results, start = [], 0
        for n, length in enumerate(problem.seq_lens):
            sl = slice(start, start + length)
            results.append(_sequence_forward(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], eta[:, :, sl],
                None if eta_key is None else eta_key[:, :, sl], w4, b4,
                h0[n:n + 1], hb0[n:n + 1], *args))
            start += length
        pieces, states, biases = zip(*results)
        o, ht, hbt = torch.cat(pieces, 2), torch.cat(states), torch.cat(biases)

    o = output_form(problem.output, o, q, w4, b4, problem.eps)
    o = o.transpose(1, 2).to(problem.dtype)
    if not problem.output_final_state:
        ht = hbt = None
    return o, ht, hbt


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
        found = dict(zip(wanted, grads))
        return Gradients(**{GRADIENT_FIELDS[name]: grad for name, grad in found.items()})
