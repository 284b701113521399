"""One warm-up call: its configuration, its call form, its inputs, and running it.

Both sides of a warm-up run these calls: the warm-up's own process (``ttt.warmup``) and its
worker processes (``ttt._warmup_workers``), which get them as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import WarmupShape
from .ops import chunk_ttt_linear


@dataclass(frozen=True)
class CallForm:
    """How one warm-up call passes the optional arguments (see ``ttt.warmup``'s docstring):
    ``initial`` states, ``final`` states out, the ``layer``'s eta_key and output form."""

    name: str
    initial: bool
    final: bool
    layer: bool = False


FORMS = (CallForm("plain", False, False), CallForm("initial", True, False),
         CallForm("final", False, True), CallForm("states", True, True),
         CallForm("layer", True, False, layer=True),
         CallForm("layer_cache", True, True, layer=True))

FORMS_BY_NAME = {form.name: form for form in FORMS}


@dataclass(frozen=True)
class Config:
    """One configuration a warm-up compiles for."""

    dtype: torch.dtype
    head_dim: int
    chunk_size: int
    heads: int

    def describe(self) -> str:
        return (f"{str(self.dtype).replace('torch.', '')} D={self.head_dim} "
                f"chunk={self.chunk_size} H={self.heads}")


def call_inputs(config: Config, layout: WarmupShape, form: CallForm,
                params: tuple[torch.dtype, torch.dtype], device: torch.device,
                grad: bool) -> dict:
    """Random inputs of one call, ``params`` the dtypes of (``w``, ``b``) and of (``eta``,
    ``eta_key``) (values matter little; they stay finite)."""
    N, T, H, D = layout.sequences, layout.seq_len, config.heads, config.head_dim
    B, L = (1, N * T) if layout.packed else (N, T)
    gen = torch.Generator(device).manual_seed(0)
    dt, (affine, rates) = config.dtype, params
    state_dt = torch.float64 if dt == torch.float64 else torch.float32

    def rand(*shape, dtype=dt):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    k = rand(B, L, H, D)
    inputs = dict(q=rand(B, L, H, D), k=k / k.norm(dim=-1, keepdim=True), v=rand(B, L, H, D),
                  w=1 + 0.1 * rand(H, D, dtype=affine), b=0.1 * rand(H, D, dtype=affine),
                  eta=0.05 * torch.rand((B, L, H, 1), generator=gen, device=device,
                                        dtype=rates))
    if form.initial:
        inputs.update(initial_state=0.1 * rand(N, H, D, D, dtype=state_dt),
                      initial_state_bias=0.1 * rand(N, H, 1, D, dtype=state_dt))
    if form.layer:
        inputs["eta_key"] = 0.5 + torch.rand((B, L, H, 1), generator=gen, device=device,
                                             dtype=rates)
    if grad:
        for t in inputs.values():
            t.requires_grad_(True)
    if layout.packed:
        inputs["cu_seqlens"] = torch.arange(0, N * T + 1, T, device=device, dtype=torch.int64)
    return inputs


def run_call(backend: str, config: Config, layout: WarmupShape, form: CallForm,
             params: tuple[torch.dtype, torch.dtype], grad: bool, device: torch.device) -> None:
    """One call: forward without gradients, or forward and backward."""
    inputs = call_inputs(config, layout, form, params, device, grad)
    kwargs = dict(chunk_size=config.chunk_size, output_final_state=form.final,
                  backend=backend)
    if form.layer:
        kwargs.update(scale=1.0, output="query_residual")
    with torch.set_grad_enabled(grad):
        outputs = [t for t in chunk_ttt_linear(**inputs, **kwargs) if t is not None]
        if grad:
            leaves = [t for t in inputs.values() if t.requires_grad]
            cotangents = [torch.randn_like(t) for t in outputs]
            torch.autograd.grad(outputs, leaves, cotangents)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
