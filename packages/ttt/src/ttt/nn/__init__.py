"""``torch.nn`` layers on ttt's operators: :class:`TTTLinear` and :class:`TTTMLP`, the
official TTT-Linear and TTT-MLP layers (their state dicts load unchanged), and
:class:`TTTCache`, their generation cache.
See docs/nn.md."""

from .cache import LayerState, TTTCache
from .layer import TTTMLP, TTTLinear

__all__ = ["LayerState", "TTTCache", "TTTLinear", "TTTMLP"]
