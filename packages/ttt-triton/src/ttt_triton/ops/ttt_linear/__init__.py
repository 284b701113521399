"""Chunked TTT-linear kernels: sequential chains (``fwd_chain``, ``bwd_chain``), group-parallel
kernels (``fwd_out``, ``bwd_local``, ``bwd_grads``), shared device helpers (``common``) and
the launchers (``launcher``). Importing this package imports triton."""

from .launcher import ttt_linear_bwd, ttt_linear_fwd

__all__ = ["ttt_linear_fwd", "ttt_linear_bwd"]
