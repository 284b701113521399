"""Chunked TTT-linear: forward kernel (``fwd.py``), backward kernel (``bwd.py``), launchers
(``launcher.py``). Importing this package imports triton."""

from .launcher import ttt_linear_bwd, ttt_linear_fwd

__all__ = ["ttt_linear_fwd", "ttt_linear_bwd"]
