"""Chunked TTT-MLP kernels: the forward chain (``fwd_chain``) and its launcher
(``launcher``). Importing this package imports triton."""

from .launcher import ttt_mlp_fwd

__all__ = ["ttt_mlp_fwd"]
