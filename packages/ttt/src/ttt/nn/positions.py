"""Token positions: the layer's rotary embedding and ``token_idx`` read a token's position
within its mini-batch (``position % mini_batch_size``), counted from its sequence's start
(packed sequences restart at 0) plus the tokens a generation cache has seen."""

from __future__ import annotations

import torch


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
