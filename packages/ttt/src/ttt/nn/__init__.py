"""``torch.nn`` layers on ttt's operator: :class:`TTTLinear`, the official TTT-Linear
layer (its state dict loads unchanged), and :class:`TTTCache`, its generation cache.
See docs/nn.md."""

from .cache import LayerState, TTTCache
from .layer import TTTLinear

__all__ = ["LayerState", "TTTCache", "TTTLinear"]
