"""The launch rules per shape class, what a Tuning forces, and how a bad Tuning is refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import ttt  # noqa: E402
from ttt import Problem  # noqa: E402
from ttt_triton.ops.ttt_linear import launcher, tuning  # noqa: E402
from ttt_triton.ops.ttt_linear.tuning import DEFAULT_TUNING, Tuning  # noqa: E402


def _problem(B, T, H, D, chunk_size=16, dtype=torch.bfloat16):
    x = torch.empty(B, T, H, D, dtype=dtype)    # only shapes matter here
    return Problem(x, x, x, torch.ones(H, D), torch.zeros(H, D), torch.empty(B, T, H, 1),
                   scale=D ** -0.5, eps=1e-6, chunk_size=chunk_size, initial_state=None,
                   initial_state_bias=None, output_final_state=False, cu_seqlens=None,
                   seq_lens=(T,) * B, eta_is_tensor=True)


def test_warps_doubling_rule():
    chain = tuning.NUM_WARPS["chain"]
    assert tuning.num_warps("chain", 64, ieee=False) == chain
    assert tuning.num_warps("chain", 128, ieee=False) == min(2 * chain, 8)
    assert tuning.num_warps("chain", 64, ieee=True) == min(2 * chain, 8)
    assert tuning.num_warps("chain", 32, ieee=True) == chain


def test_forced_warps_and_stages():
    """Forced values apply as given, to every dtype and head dim of their kind."""
    forced = Tuning(chain_warps=2, group_warps=8, group_stages=3)
    assert tuning.num_warps("chain", 128, ieee=True, tune=forced) == 2
    assert tuning.launch_options("group", 64, False, forced) == dict(num_warps=8, num_stages=3)
    assert tuning.launch_options("group", 64, True, forced)["num_stages"] == 3
    assert (tuning.launch_options("chain", 64, False, forced)["num_stages"]
            == tuning.NUM_STAGES["chain_stages"])


def test_fused_backward_chain_stages():
    """The fused backward chain takes fused_bwd_stages for half inputs; float32 and the
    unfused chain keep their own entries."""
    stages = tuning.NUM_STAGES

    def chain_stages(ieee, fused_bwd):
        return tuning.launch_options("chain", 64, ieee, DEFAULT_TUNING, fused_bwd)["num_stages"]

    assert chain_stages(False, True) == stages["fused_bwd_stages"]
    assert chain_stages(False, False) == stages["chain_stages"]
    assert chain_stages(True, True) == stages["chain_stages_fp32"]


def test_interpreter_takes_no_compiler_options(monkeypatch):
    monkeypatch.setattr(launcher, "kernels_interpreted", lambda: True)
    assert launcher._launch("group", 64, torch.bfloat16, Tuning(group_warps=8)) == {}
    monkeypatch.setattr(launcher, "kernels_interpreted", lambda: False)
    assert launcher._launch("group", 64, torch.bfloat16, Tuning(group_warps=8))["num_warps"] == 8


HALF_64 = dict(BD=64, ieee=False)


def test_rows_per_block_default_forced_and_clamped():
    assert (tuning.rows_per_block("S_out", 16, 16, DEFAULT_TUNING, **HALF_64)
            == tuning.BLOCK_ROWS["S_out"])
    forced = Tuning(rows_out=32)
    assert tuning.rows_per_block("S_out", 16, 16, forced, **HALF_64) == 32
    assert tuning.rows_per_block("S_out", 64, 16, forced, **HALF_64) == 64     # at least a chunk
    assert tuning.rows_per_block("S_out", 16, 1, forced, **HALF_64) == 16      # at most a group
    assert tuning.rows_per_block("S_grads", 16, 16, Tuning(rows_grads=128), **HALF_64) == 128


@pytest.mark.parametrize("shape, G", [
    ((8, 2048, 12, 64), 16),     # 384 groups of 32 x 4 warps < 2048 warps: narrow
    ((4, 4096, 16, 64), 32),     # 512 x 4 = 2048: wide
    ((4, 4096, 8, 128), 32),     # 256 groups x 8 warps (BD 128): wide
    ((1, 64, 2, 32), 16),        # tiny: narrow
])
def test_checkpoint_interval_rule(shape, G):
    p = _problem(*shape)
    BD = launcher.block_sizes(p.D, p.chunk_size)[1]
    assert tuning.checkpoint_interval(p, BD, DEFAULT_TUNING) == G


def test_checkpoint_interval_forced():
    p = _problem(4, 4096, 16, 64)
    assert tuning.checkpoint_interval(p, 64, Tuning(checkpoint_interval=4)) == 4


@pytest.mark.parametrize("shape, chunk, fwd_inference, fwd_training, bwd", [
    ((32, 2048, 16, 64), 16, True, True, True),      # 512 chains
    ((8, 2048, 12, 64), 16, True, False, False),     # 96 chains
    ((1, 32768, 16, 64), 16, False, False, False),   # 16 chains: latency bound
    ((32, 2048, 16, 64), 32, True, True, False),     # backward fused for chunk 16 only
    ((32, 2048, 16, 128), 16, True, True, False),    # ... and head dims <= 64
])
def test_fused_chain_rule(shape, chunk, fwd_inference, fwd_training, bwd):
    p = _problem(*shape, chunk_size=chunk)
    assert tuning.fused_forward(p, False, DEFAULT_TUNING) == fwd_inference
    assert tuning.fused_forward(p, True, DEFAULT_TUNING) == fwd_training
    assert tuning.fused_backward(p, DEFAULT_TUNING) == bwd


def test_fused_chains_forced():
    forced = Tuning(fuse_forward=False, fuse_backward=True)
    assert not tuning.fused_forward(_problem(32, 2048, 16, 64), False, forced)
    assert tuning.fused_backward(_problem(1, 64, 1, 128, chunk_size=64), forced)


@pytest.mark.parametrize("dtype, BD, BT, split", [
    (torch.bfloat16, 128, 64, 2),    # the wide backward
    (torch.float16, 128, 64, 2),
    (torch.float32, 128, 64, 1),     # IEEE dots: no fp32 staging in shared memory
    (torch.bfloat16, 128, 32, 1),
    (torch.bfloat16, 64, 64, 1),
])
def test_grads_split_rule(dtype, BD, BT, split):
    assert tuning.grads_split(dtype, BD, BT, DEFAULT_TUNING) == split


def test_grads_split_forced_needs_wide_enough_tiles():
    assert tuning.grads_split(torch.float32, 32, 16, Tuning(grads_split=2)) == 2
    assert tuning.grads_split(torch.bfloat16, 128, 64, Tuning(grads_split=1)) == 1
    with pytest.raises(ValueError, match=r"Tuning\.grads_split: 2 needs a padded head dim "
                                         r"of at least 32, got 16"):
        tuning.grads_split(torch.float32, 16, 16, Tuning(grads_split=2))


@pytest.mark.parametrize("field, value, expected", [
    ("checkpoint_interval", 3, "a power of two"),
    ("checkpoint_interval", 0, "a power of two"),
    ("checkpoint_interval", True, "a power of two"),
    ("checkpoint_interval", "4", "a power of two"),
    ("fuse_forward", 1, "a bool"),
    ("fuse_backward", "yes", "a bool"),
    ("grads_split", 4, "1 or 2"),
    ("rows_out", 8, "a power of two >= 16"),
    ("rows_local", 48, "a power of two >= 16"),
    ("rows_grads", 32.0, "a power of two >= 16"),
    ("chain_warps", 3, "1, 2, 4, 8 or 16"),
    ("group_stages", 0, "an int from 1 to 8"),
])
def test_invalid_tuning_names_field_expected_and_actual(field, value, expected):
    with pytest.raises(ValueError) as info:
        Tuning(**{field: value})
    message = str(info.value)
    assert message.startswith(f"Tuning.{field}: expected ")
    assert expected in message and repr(value) in message and type(value).__name__ in message


def test_unknown_tuning_field_is_refused():
    with pytest.raises(TypeError, match="S_out"):
        Tuning(S_out=64)


def test_launcher_refuses_what_is_not_a_tuning():
    p = _problem(1, 16, 1, 16, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"tuning: expected .*Tuning, got dict"):
        launcher.ttt_linear_fwd(p, False, tuning={"fuse_forward": True})


def test_float32_at_head_dim_128_or_chunk_64_takes_the_ieee_wide_rules():
    """Where float32's IEEE products spill (tuning.IEEE_WIDE): blocks of at most 32 rows at
    head dim 128, bwd_local with 16 warps at chunk 64, and no fused forward chain, not even
    for a generation step or many chains; forcing still wins. Elsewhere, the usual rules."""
    rows = tuning.IEEE_WIDE["rows"]
    assert tuning.rows_per_block("S_out", 16, 16, DEFAULT_TUNING, BD=128, ieee=True) == rows
    assert tuning.rows_per_block("S_out", 64, 16, DEFAULT_TUNING, BD=128, ieee=True) == 64
    assert tuning.rows_per_block("S_out", 16, 16, DEFAULT_TUNING, BD=128, ieee=False) == 64
    assert tuning.rows_per_block("S_out", 16, 16, Tuning(rows_out=64), BD=128, ieee=True) == 64
    local = tuning.IEEE_WIDE["local_warps"]
    assert tuning.num_warps("local", 64, True, DEFAULT_TUNING, BT=64) == local
    assert tuning.num_warps("local", 128, True, DEFAULT_TUNING, BT=64) == local
    assert tuning.num_warps("local", 128, True, DEFAULT_TUNING, BT=32) == 8
    assert tuning.num_warps("local", 64, False, DEFAULT_TUNING, BT=64) == 4
    assert tuning.num_warps("group", 64, True, DEFAULT_TUNING, BT=64) == 8
    assert tuning.num_warps("local", 64, True, Tuning(group_warps=2), BT=64) == 2
    for shape, chunk, fused in (((1, 48, 4, 128), 64, False), ((1, 16, 4, 128), 16, False),
                                ((1, 48, 4, 64), 64, False), ((1, 16, 4, 64), 16, True),
                                ((1, 30, 4, 64), 32, True)):
        q = torch.randn(shape)
        p = ttt.make_problem(q, q, q, torch.ones(4, shape[3]), torch.zeros(4, shape[3]), 0.1,
                             chunk_size=chunk)
        assert ttt.schedule.generation_step(p, False)
        assert tuning.fused_forward(p, False, DEFAULT_TUNING) is fused, (shape, chunk)
        assert tuning.fused_forward(p, False, Tuning(fuse_forward=True))
        half = ttt.make_problem(q.bfloat16(), q.bfloat16(), q.bfloat16(),
                                torch.ones(4, shape[3]), torch.zeros(4, shape[3]), 0.1,
                                chunk_size=chunk)
        assert tuning.fused_forward(half, False, DEFAULT_TUNING)
