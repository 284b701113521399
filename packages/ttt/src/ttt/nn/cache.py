"""Generation cache for TTT-Linear layers: committed inner states plus the open mini-batch.

The inner model of a TTT-Linear layer takes one gradient step per full mini-batch. Within a
mini-batch, token ``i`` reads the state the mini-batch started from, stepped by the tokens
``j <= i`` of the same mini-batch. So generation keeps, per layer:

- the **committed** state ``W [B, H, D, D]``, ``b [B, H, 1, D]``: the inner model after the
  last full mini-batch (float32; float64 for a float64 layer);
- the **pending** tokens of the open mini-batch (fewer than ``mini_batch_size``): their
  rotated ``q, k``, ``v`` and key learning-rate factor, which is all a later step needs;
- the number of tokens seen, which places the next token in its mini-batch (rotary
  position and ``token_idx``).

A step recomputes only the pending tokens and the new ones from the committed state; when a
mini-batch fills up, its final state becomes the committed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LayerState:
    """One layer's entry in a :class:`TTTCache`."""

    state: torch.Tensor         # [B, H, D, D] committed inner weight
    state_bias: torch.Tensor    # [B, H, 1, D] committed inner bias
    q: torch.Tensor             # [B, P, H, D] pending tokens (P < mini_batch_size), rotated
    k: torch.Tensor             # [B, P, H, D] rotated
    v: torch.Tensor             # [B, P, H, D]
    eta_key: torch.Tensor       # [B, P, H, 1]
    seen: int                   # tokens seen so far

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]


class TTTCache:
    """Cache for generation through a stack of :class:`ttt.nn.TTTLinear` layers.

    One object serves a whole model: pass the same cache to every layer
    (``layer(x, cache=cache)``); each layer keeps its own :class:`LayerState`, keyed by the
    layer module. An empty cache starts every layer from its learned ``W1, b1``. The tensors
    keep their autograd history when gradients are enabled; generate under
    ``torch.no_grad()`` (or ``torch.inference_mode()``).
    """

    def __init__(self) -> None:
        self._layers: dict[nn.Module, LayerState] = {}

    def get(self, layer: nn.Module) -> LayerState | None:
        """The layer's entry, or None before its first call with this cache."""
        return self._layers.get(layer)

    def put(self, layer: nn.Module, entry: LayerState) -> None:
        self._layers[layer] = entry

    @property
    def seen_tokens(self) -> int:
        """Tokens seen by the layers of this cache (0 when empty)."""
        return max((entry.seen for entry in self._layers.values()), default=0)

    def reset(self) -> None:
        """Forget every layer's state (the next call starts a new sequence)."""
        self._layers.clear()

    def __len__(self) -> int:
        return len(self._layers)
