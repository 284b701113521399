"""Fixtures of the core's tests."""

from __future__ import annotations

import contextlib

import pytest

import ttt


@pytest.fixture
def register():
    """``register(name, backend, **options)``: ``ttt.register_backend`` for one test, every
    registration undone at its end."""
    with contextlib.ExitStack() as undo:
        yield lambda *args, **options: undo.enter_context(ttt.register_backend(*args, **options))
