"""The tolerance table, under its former name: it lives in :mod:`ttt.tolerances` (the
product's, which ``python -m ttt demo`` uses too); this module re-exports it for suites that
import it from here."""

from __future__ import annotations

from ..tolerances import SEGMENT_FACTOR, TOLERANCES

__all__ = ["SEGMENT_FACTOR", "TOLERANCES"]
