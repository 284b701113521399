"""Token positions inside a TTT mini-batch.

The official TTT-Linear layer feeds two things the position of a token *within its
mini-batch* (``position % mini_batch_size``): the rotary embedding of q and k, and the
per-position inner learning-rate factor ``token_idx``. A position counts from the start of
its sequence (packed sequences restart at 0) plus the tokens a generation cache has seen.
"""

from __future__ import annotations

import torch


def sequence_positions(num_tokens: int, device: torch.device, *, offset: int = 0,
                       cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Position of each token in its sequence, ``[T]`` int64.

    Without ``cu_seqlens``: ``offset, offset + 1, ...`` (``offset``: tokens already seen).
    With ``cu_seqlens`` (``[N + 1]`` offsets of packed sequences): each restarts at 0.
    Computed on the device, without a host sync.
    """
    steps = torch.arange(num_tokens, device=device)                  # [T]
    if cu_seqlens is None:
        return steps + offset
    starts = cu_seqlens.to(device=device, dtype=torch.int64)         # [N + 1]
    sequence = torch.searchsorted(starts[1:], steps, right=True)    # [T] sequence of each token
    return steps - starts[sequence]
