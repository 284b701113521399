"""``torch.nn`` layers on ttt's operator.

- :class:`TTTLinear`: the official TTT-Linear layer (parameter names and shapes of
  test-time-training/ttt-lm-pytorch, so its state dict loads unchanged).
- :class:`TTTCache`: the generation cache (committed inner states, the open mini-batch).

See docs/nn.md.
"""

from .cache import LayerState, TTTCache
from .layer import TTTLinear

__all__ = ["LayerState", "TTTCache", "TTTLinear"]
