"""Rotary embedding of the official TTT-Linear layer (ttt-lm-pytorch, ``ttt.py``): each pair
``(x[2i], x[2i + 1])`` of a head rotated by ``p * theta ** (-2i / D)``, the official
``permute_qk`` / ``rotate_half`` / ``undo_permute_qk`` without the permutations (docs/nn.md);
and the positions ``p`` it and ``token_idx`` read (``position % mini_batch_size``), counted
from the sequence's start (packed sequences restart at 0) plus the tokens a cache has seen.
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


def sequence_positions(num_tokens: int, device: torch.device, *, offset: int = 0,
                       cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Position of each token in its sequence, ``[T]`` int64, without a host sync: from
    ``offset`` (tokens already seen), or restarting at 0 at each ``cu_seqlens`` offset."""
    steps = torch.arange(num_tokens, device=device)                  # [T]
    if cu_seqlens is None:
        return steps + offset
    starts = cu_seqlens.to(device=device, dtype=torch.int64)         # [N + 1]
    sequence = torch.searchsorted(starts[1:], steps, right=True)    # [T] sequence of each token
    return steps - starts[sequence]
