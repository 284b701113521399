"""The LayerNorm-L2 inner loss both inner models train on, and the op's output forms, in
PyTorch (the reference backend's and ``ttt.reference_mlp``'s)."""

from __future__ import annotations

import torch


def layer_norm_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x.mean(-1, keepdim=True)
    centered = x - mean
    rstd = torch.rsqrt((centered * centered).mean(-1, keepdim=True) + eps)
    return centered * rstd, rstd


def layer_norm_l2_grad(z, k, v, w, b, eps: float) -> torch.Tensor:
    """The inner loss's gradient with respect to the prediction ``z`` (rows of [.., L, D]):
    the closed form of ``1/2 ||LN(z) * w + b - (v - k)||^2``."""
    x_hat, rstd = layer_norm_stats(z, eps)
    y = (x_hat * w + b - v + k) * w
    return rstd * (y - y.mean(-1, keepdim=True) - x_hat * (y * x_hat).mean(-1, keepdim=True))


def output_form(output: str, z: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor, eps: float) -> torch.Tensor:
    """z [B, H, T, D] to the requested output form (q unscaled, like z)."""
    if output == "raw":
        return z
    z_hat, _ = layer_norm_stats(z, eps)
    residual = q if output == "query_residual" else z
    return residual + z_hat * w + b
