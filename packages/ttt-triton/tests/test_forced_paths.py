"""Every launch path a :class:`Tuning` can force, against the float64 oracle: small
checkpoint intervals and blocks (several groups per sequence, several chunks per block,
blocks clamped to a chunk or a group), the fused chains with and without a backward, and
the split bwd_grads. The launcher is called directly with ``tuning=``; outputs, final
states and every gradient are compared. Runs on CUDA when there is a GPU (every dtype), else
in the Triton interpreter (float32)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import launcher_cases as cases  # noqa: E402

from ttt_triton.ops.ttt_linear.tuning import Tuning  # noqa: E402

cases.skip_unless_kernels_run()


@pytest.mark.parametrize("tuning,chunk,seq_lens", [
    # 2 chunks per block, 2 blocks per group, 3 groups
    (Tuning(checkpoint_interval=4, rows_out=32, rows_local=32, rows_grads=32), 16, None),
    # blocks clamped to the group (32 rows), varlen with a one-row sequence
    (Tuning(checkpoint_interval=2, rows_out=64, rows_local=64, rows_grads=64), 16, (37, 50, 1)),
    # 4 chunks per block
    (Tuning(checkpoint_interval=4, rows_out=64, rows_local=64, rows_grads=64), 16, (70, 33)),
    # blocks below the chunk: one chunk per block
    (Tuning(checkpoint_interval=2, rows_out=16, rows_local=16, rows_grads=16), 32, None),
    # one chunk per group
    (Tuning(checkpoint_interval=1), 16, (37, 20)),
], ids=["blocks-of-2-chunks", "blocks-clamped-to-group", "blocks-of-4-chunks",
        "blocks-below-chunk", "group-of-one-chunk"])
def test_small_groups_and_blocks(tuning, chunk, seq_lens):
    T = sum(seq_lens) if seq_lens else 165
    errs = cases.oracle_errors(T, 2, 32, chunk, seq_lens, 11, tuning)
    cases.assert_within_bounds(errs, torch.float32, tuning)


FORCED_CHAINS = [
    (Tuning(fuse_forward=False), False),
    (Tuning(fuse_forward=True), False),
    (Tuning(fuse_forward=False, fuse_backward=False), True),
    (Tuning(fuse_forward=True, fuse_backward=True), True),
    (Tuning(fuse_forward=True, fuse_backward=False), True),
    (Tuning(fuse_forward=False, fuse_backward=True), True),
]
FORCED_CHAIN_IDS = ["split-fwd-only", "fused-fwd-only", "split-both", "fused-both",
                    "fused-fwd-split-bwd", "split-fwd-fused-bwd"]


@pytest.mark.parametrize("tuning,with_grad", FORCED_CHAINS, ids=FORCED_CHAIN_IDS)
@pytest.mark.parametrize("chunk,seq_lens", [(16, None), (32, (37, 50, 1))])
def test_fused_chains(tuning, with_grad, chunk, seq_lens):
    """The chains doing the parallel kernels' work (forward: the outputs, backward: dk, dv
    and the last-row deta) and the split kernels, with and without a backward: partial last
    chunks, varlen, initial states, several groups (G = 2)."""
    tuning = Tuning(**{**vars(tuning), "checkpoint_interval": 2})
    T = sum(seq_lens) if seq_lens else 85
    errs = cases.oracle_errors(T, 2, 32, chunk, seq_lens, 13, tuning, with_grad=with_grad)
    cases.assert_within_bounds(errs, torch.float32, tuning)


@pytest.mark.parametrize("chunk,seq_lens", [(16, (40, 25)), (64, None)])
def test_split_grads_kernel(chunk, seq_lens):
    """bwd_grads in two programs per (group, head), each with half of k's columns (the
    launcher's choice at chunk 64 and head dim 128 with half inputs), on float32."""
    # (one stage: at chunk 64 float32 tiles with two would need more shared memory than
    # an H100 or H200 block has)
    tuning = Tuning(grads_split=2, checkpoint_interval=2,
                    group_stages=1 if chunk == 64 else None)
    T = sum(seq_lens) if seq_lens else 150
    errs = cases.oracle_errors(T, 2, 40, chunk, seq_lens, 17, tuning)
    cases.assert_within_bounds(errs, torch.float32, tuning)


@cases.NEEDS_GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tuning,with_grad", FORCED_CHAINS, ids=FORCED_CHAIN_IDS)
@pytest.mark.parametrize("D,chunk", [(50, 16), (64, 32), (128, 64)])
def test_forced_chains_on_gpu(dtype, tuning, with_grad, D, chunk):
    """Every dtype, the fused and the split kernels in every combination, at an unaligned
    head dim, the IEEE K-blocked dots (float32 at D 128) and the wide backward (half inputs
    at D 128, chunk 64), against the oracle within the conformance suite's bounds."""
    errs = cases.oracle_errors(180, 3, D, chunk, (60, 120), 9, tuning, with_grad=with_grad,
                               dtype=dtype)
    cases.assert_within_bounds(errs, dtype, tuning)


@pytest.mark.parametrize("tuning,fwd_out,bwd_grads,split", [
    (Tuning(fuse_forward=True, fuse_backward=True), 0, 0, None),
    (Tuning(fuse_forward=False, fuse_backward=False), 1, 1, 1),
    (Tuning(fuse_forward=False, fuse_backward=False, grads_split=2), 1, 1, 2),
])
def test_forcing_takes_the_path(monkeypatch, tuning, fwd_out, bwd_grads, split):
    """What a Tuning forces is what launches: the fused chains skip fwd_out / bwd_grads, a
    forced split launches bwd_grads with that many programs per (group, head)."""
    from ttt_triton.ops.ttt_linear import launcher

    spies = {}
    for name in ("ttt_linear_fwd_out_kernel", "ttt_linear_bwd_grads_kernel"):
        spies[name] = cases.LaunchSpy(getattr(launcher, name))
        monkeypatch.setattr(launcher, name, spies[name])
    cases.oracle_errors(40, 2, 32, 16, None, 3, tuning)
    assert len(spies["ttt_linear_fwd_out_kernel"].grids) == fwd_out
    grads_grids = spies["ttt_linear_bwd_grads_kernel"].grids
    assert len(grads_grids) == bwd_grads
    if split is not None:
        assert grads_grids[0][2] == split


class _OutOfSharedMemory:
    """Stands in for a kernel whose compiled form needs more shared memory than the device
    has: Triton raises OutOfResources when it loads it, before it runs."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self._refuse()
        return launch

    def warmup(self, *args, **kwargs):      # compiling ahead loads it too (launches.py)
        self._refuse()

    @staticmethod
    def _refuse():
        from triton.runtime.errors import OutOfResources

        raise OutOfResources(377344, 232448, "shared memory")


def test_unfit_forced_tuning_is_refused_with_the_need_and_the_limit(monkeypatch):
    """A forced Tuning whose kernel cannot fit is a ValueError naming the forced fields, the
    need and the limit; with the rules' own choices the error is Triton's, untouched."""
    from triton.runtime.errors import OutOfResources

    from ttt_triton.ops.ttt_linear import launcher

    monkeypatch.setattr(launcher, "ttt_linear_bwd_grads_kernel", _OutOfSharedMemory())
    forced = Tuning(grads_split=2, checkpoint_interval=2, fuse_backward=False)
    x, _ = cases.inputs(40, 2, 32, None, 3)
    dys = [torch.randn(s, dtype=cases.F64) for s in ((1, 40, 2, 32), (1, 2, 32, 32), (1, 2, 1, 32))]
    with pytest.raises(ValueError, match=r"grads_split=2.*377344 bytes of shared memory.*"
                                         r"allows 232448"):
        cases.launch(cases.problem(x, None, 16), dys, forced)
    with pytest.raises(OutOfResources):
        cases.launch(cases.problem(x, None, 16), dys, Tuning())
