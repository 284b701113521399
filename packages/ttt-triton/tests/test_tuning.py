"""The launch tunables: defaults, the doubling rule and the TTT_TRITON_TUNE override."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from ttt_triton.ops.ttt_linear import launcher  # noqa: E402


def test_defaults_and_doubling(monkeypatch):
    monkeypatch.delenv("TTT_TRITON_TUNE", raising=False)
    chain = launcher.NUM_WARPS["chain"]
    assert launcher.num_warps("chain", 64, ieee=False) == chain
    assert launcher.num_warps("chain", 128, ieee=False) == min(2 * chain, 8)
    assert launcher.num_warps("chain", 64, ieee=True) == min(2 * chain, 8)
    assert launcher.num_warps("chain", 32, ieee=True) == chain


def test_environment_override(monkeypatch):
    monkeypatch.setenv("TTT_TRITON_TUNE", "chain=2, group=8, S_out=32")
    assert launcher.num_warps("chain", 64, ieee=False) == 2
    assert launcher.num_warps("group", 64, ieee=False) == 8
    assert launcher.num_warps("group", 128, ieee=False) == 8
    assert launcher.tunables()["S_out"] == 32
    assert launcher.rows_per_block("S_out", 16, 16, launcher.tunables()) == 32
    assert launcher.rows_per_block("S_out", 64, 16, launcher.tunables()) == 64   # >= a chunk
    assert launcher.rows_per_block("S_out", 16, 1, launcher.tunables()) == 16    # <= a group


def test_checkpoint_interval_override(monkeypatch):
    monkeypatch.delenv("TTT_TRITON_TUNE", raising=False)
    assert launcher.tunables()["G"] == launcher.CKPT_INTERVAL
    monkeypatch.setenv("TTT_TRITON_TUNE", "G=4")
    assert launcher.tunables()["G"] == 4
