"""Generation cache for TTT layers: per layer, the inner state committed after the last full
mini-batch, the pending tokens of the open one and the tokens seen; a step recomputes the
pending and new tokens from the committed state (docs/nn.md, "Generation cache").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..validation import dtype_name


@dataclass
class LayerState:
    """One layer's entry in a :class:`TTTCache`."""

    states: tuple[torch.Tensor, ...]    # committed inner state, [B, ...] each
    q: torch.Tensor             # [B, P, H, D] pending tokens (P < mini_batch_size), rotated
    k: torch.Tensor             # [B, P, H, D] rotated
    v: torch.Tensor             # [B, P, H, D]
    eta_key: torch.Tensor       # [B, P, H, 1]
    seen: int                   # tokens seen so far

    @property
    def batch_size(self) -> int:
        return self.q.shape[0]

    def _map(self, fn) -> LayerState:
        """This entry with ``fn`` applied to each tensor."""
        return LayerState(tuple(map(fn, self.states)),
                          *map(fn, (self.q, self.k, self.v, self.eta_key)), seen=self.seen)


class TTTCache:
    """Cache for generation through a stack of :class:`ttt.nn.TTTLinear` or
    :class:`ttt.nn.TTTMLP` layers: one :class:`LayerState` per layer module. Stored tensors
    are detached unless ``requires_grad`` (to backpropagate through the cache across calls).
    """

    def __init__(self, requires_grad: bool = False) -> None:
        if not isinstance(requires_grad, bool):
            raise TypeError(f"requires_grad: expected a bool, got {type(requires_grad).__name__}")
        self.requires_grad = requires_grad
        self._layers: dict[nn.Module, LayerState] = {}

    def get(self, layer: nn.Module) -> LayerState | None:
        """The layer's entry, or None before its first call with this cache."""
        return self._layers.get(layer)

    def put(self, layer: nn.Module, entry: LayerState) -> None:
        """Store the layer's entry (detached unless the cache has ``requires_grad``)."""
        self._layers[layer] = entry if self.requires_grad else entry._map(torch.Tensor.detach)

    @property
    def batch_size(self) -> int | None:
        """The batch size of the stored states (None when empty)."""
        return next((entry.batch_size for entry in self._layers.values()), None)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch of every stored state (beam search): row ``i`` becomes row
        ``beam_idx[i]`` (1-d integer tensor or sequence of ints: the new batch)."""
        if not isinstance(beam_idx, torch.Tensor):
            if isinstance(beam_idx, (str, bytes)) or not hasattr(beam_idx, "__len__"):
                raise TypeError(f"beam_idx: expected a 1-d integer tensor or a sequence of "
                                f"ints, got {type(beam_idx).__name__}")
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in beam_idx):
                raise TypeError("beam_idx: expected a 1-d integer tensor or a sequence of "
                                "ints, got a sequence with other items")
            beam_idx = torch.tensor(list(beam_idx), dtype=torch.int64)
        dtype = beam_idx.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"beam_idx: expected an integer dtype, got {dtype_name(dtype)}")
        if beam_idx.dim() != 1 or beam_idx.numel() == 0:
            raise ValueError(f"beam_idx: expected a non-empty 1-d tensor, got shape "
                             f"{tuple(beam_idx.shape)}")
        batch = self.batch_size
        if batch is None:
            return
        if not beam_idx.is_meta:
            low, high = int(beam_idx.min()), int(beam_idx.max())   # (one host sync)
            if low < 0 or high >= batch:
                raise ValueError(f"beam_idx: expected indices in [0, {batch}) (the cache's "
                                 f"batch size), got values from {low} to {high}")
        for layer, entry in self._layers.items():
            index = beam_idx.to(device=entry.q.device, dtype=torch.int64)
            self._layers[layer] = entry._map(lambda t, index=index: t.index_select(0, index))

    @property
    def seen_tokens(self) -> int:
        """Tokens seen by the layers of this cache (0 when empty)."""
        return max((entry.seen for entry in self._layers.values()), default=0)

    def reset(self) -> None:
        """Forget every layer's state (the next call starts a new sequence)."""
        self._layers.clear()

    def __len__(self) -> int:
        return len(self._layers)
