r"""Rotary embedding of the official TTT-Linear layer (ttt-lm-pytorch, ``ttt.py``).

Per head, the pair of features ``(x[2i], x[2i + 1])`` is rotated by the angle
``p * theta ** (-2i / D)``, with ``p`` the token's position within its mini-batch:

.. math::

    x'_{2i} = x_{2i} \cos\phi_i - x_{2i+1} \sin\phi_i, \qquad
    x'_{2i+1} = x_{2i+1} \cos\phi_i + x_{2i} \sin\phi_i

The official code reaches the same numbers by permuting the features to the half-split
layout (``permute_qk``), applying the Hugging Face ``rotate_half`` rotation and permuting
back; the angles are computed in float32 and ``cos``/``sin`` cast to the input's dtype.
"""

from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[T, D / 2]`` in ``dtype`` for integer ``positions [T]``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (theta ** (exponents.float() / head_dim))       # [D / 2] float32
    angles = positions.float()[:, None] * inv_freq[None, :]          # [T, D / 2] float32
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the feature pairs of ``x [B, T, H, D]`` by ``cos, sin [T, D / 2]``."""
    pairs = x.unflatten(-1, (-1, 2))                                 # [B, T, H, D / 2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]                         # [B, T, H, D / 2]
    cos, sin = cos[:, None, :], sin[:, None, :]                      # [T, 1, D / 2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return rotated.flatten(-2)                                       # [B, T, H, D]
