"""The launch tunables: defaults, the doubling rule and the TTT_TRITON_TUNE override."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ttt import Problem  # noqa: E402
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


def _problem(B, T, H, D, chunk_size=16, dtype=torch.bfloat16):
    x = torch.empty(B, T, H, D, dtype=dtype)    # only shapes matter here
    return Problem(x, x, x, torch.ones(H, D), torch.zeros(H, D), torch.empty(B, T, H, 1),
                   scale=D ** -0.5, eps=1e-6, chunk_size=chunk_size, initial_state=None,
                   initial_state_bias=None, output_final_state=False, cu_seqlens=None,
                   seq_lens=(T,) * B, eta_is_tensor=True)


@pytest.mark.parametrize("shape, G", [
    ((8, 2048, 12, 64), 16),     # 384 groups of 32 x 4 warps < 2048 warps: narrow
    ((4, 4096, 16, 64), 32),     # 512 x 4 = 2048: wide
    ((4, 4096, 8, 128), 32),     # 256 groups x 8 warps (BD 128): wide
    ((1, 64, 2, 32), 16),        # tiny: narrow
])
def test_checkpoint_interval_rule(monkeypatch, shape, G):
    monkeypatch.delenv("TTT_TRITON_TUNE", raising=False)
    tune = launcher.tunables()
    p = _problem(*shape)
    BD = launcher.block_sizes(p.D, p.chunk_size)[1]
    assert launcher.checkpoint_interval(p, BD, tune) == G


def test_checkpoint_interval_override(monkeypatch):
    monkeypatch.setenv("TTT_TRITON_TUNE", "G=4")
    p = _problem(4, 4096, 16, 64)
    assert launcher.checkpoint_interval(p, 64, launcher.tunables()) == 4


@pytest.mark.parametrize("shape, chunk, fwd_inference, fwd_training, bwd", [
    ((32, 2048, 16, 64), 16, True, True, True),      # 512 chains
    ((8, 2048, 12, 64), 16, True, False, False),     # 96 chains
    ((1, 32768, 16, 64), 16, False, False, False),   # 16 chains: latency bound
    ((32, 2048, 16, 64), 32, True, True, False),     # backward fused for chunk 16 only
    ((32, 2048, 16, 128), 16, True, True, False),    # ... and head dims <= 64
])
def test_fused_chain_rule(monkeypatch, shape, chunk, fwd_inference, fwd_training, bwd):
    monkeypatch.delenv("TTT_TRITON_TUNE", raising=False)
    tune = launcher.tunables()
    p = _problem(*shape, chunk_size=chunk)
    assert launcher.fused_forward(p, False, tune) == fwd_inference
    assert launcher.fused_forward(p, True, tune) == fwd_training
    assert launcher.fused_backward(p, tune) == bwd


def test_fused_chain_override(monkeypatch):
    monkeypatch.setenv("TTT_TRITON_TUNE", "fuse=0,fuse_bwd=1")
    p = _problem(32, 2048, 16, 64)
    assert not launcher.fused_forward(p, False, launcher.tunables())
    assert launcher.fused_backward(_problem(1, 64, 1, 128, chunk_size=64), launcher.tunables())


def test_register_cap(monkeypatch):
    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    monkeypatch.setenv("TTT_TRITON_TUNE", "group_regs=128")
    tune = launcher.tunables()
    assert launcher._launch("group", 64, torch.bfloat16, tune)["maxnreg"] == 128
    assert "maxnreg" not in launcher._launch("chain", 64, torch.bfloat16, tune)


def test_fused_backward_chain_stages(monkeypatch):
    """The fused backward chain takes fused_bwd_stages for half inputs; float32 and the
    unfused chain keep their own keys."""
    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    monkeypatch.setenv("TTT_TRITON_TUNE", "chain_stages=1,chain_stages_fp32=1,fused_bwd_stages=3")
    tune = launcher.tunables()
    assert launcher._launch("chain", 64, torch.bfloat16, tune, fused_bwd=True)["num_stages"] == 3
    assert launcher._launch("chain", 64, torch.bfloat16, tune)["num_stages"] == 1
    assert launcher._launch("chain", 64, torch.float32, tune, fused_bwd=True)["num_stages"] == 1
