"""The float64 oracle, under its former name: it lives in :mod:`ttt.oracle` (the product's,
which ``python -m ttt demo`` uses too); this module re-exports it for suites that import it
from here."""

from __future__ import annotations

from ..oracle import oracle_chunk_ttt_linear

__all__ = ["oracle_chunk_ttt_linear"]
