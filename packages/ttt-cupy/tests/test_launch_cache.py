"""No GPU needed: the host-side caches of the cupy backend, with a stand-in ``cupy`` module.

``compile.get_kernels`` must hand out one table per (pass, dtype, D_PAD, BT, device, mma), the
same kernel objects at every call: CuPy's ``RawModule.get_function`` builds a new RawKernel
each time it is asked, and ``launcher._function`` (the launch path's CUDA function, opted in to
its shared memory once) is keyed by the kernel object, so new objects per call would grow it
without bound over a training run (a leak the tenth session introduced and reverted).
"""

from __future__ import annotations

import sys

import pytest

from ttt_cupy import compile as cc
from ttt_cupy import launcher


def test_kernel_table_is_built_once(fake_cupy, monkeypatch):
    first = cc.get_kernels("bwd", "bfloat16", 64, 16, 0)
    assert set(first) == {*cc.PASSES["bwd"], cc.FUSED_BWD_NAME}   # (the fused chain: D_PAD 64)
    assert len(fake_cupy) == 4
    for _ in range(5):
        again = cc.get_kernels("bwd", "bfloat16", 64, 16, 0)
        assert again is first and again["bwd_chain"] is first["bwd_chain"]
    assert len(fake_cupy) == 4                          # no kernel object built per call
    with pytest.raises(TypeError):
        first["bwd_chain"] = None                        # read-only: one table for everyone
    # the tensor-core instances for half inputs; TTT_CUPY_MMA=0 (read at every call) gives
    # another table, of the SIMT instances
    assert first["bwd_chain"].name == cc.kernel_name("bwd_chain", "__nv_bfloat16", 64, 16, True)
    monkeypatch.setenv(cc.MMA_ENV, "0")
    simt = cc.get_kernels("bwd", "bfloat16", 64, 16, 0)
    assert simt is not first
    assert simt["bwd_chain"].name == cc.kernel_name("bwd_chain", "__nv_bfloat16", 64, 16, False)
    assert cc.FUSED_BWD_NAME not in simt                   # tensor-core instances only
    forward = cc.get_kernels("fwd", "float32", 32, 16, 1)    # another pass and device
    assert set(forward) == {*cc.PASSES["fwd"], cc.FUSED_NAME}
    assert cc.get_kernels("fwd", "float32", 32, 16, 1) is forward


def test_function_opts_in_once(fake_cupy):
    kernel = cc.get_kernels("fwd", "bfloat16", 64, 16, 0)["fwd_out"]
    for _ in range(3):
        assert launcher._function(kernel, 0, 100_000) == kernel.kernel
    assert kernel.optins == [100_000]                   # asked once, not at every launch
    launcher._function(kernel, 0, 1024)                  # below the opt-in: nothing to ask
    assert kernel.optins == [100_000]
    with pytest.raises(RuntimeError, match="shared memory"):
        launcher._function(kernel, 0, 228 * 1024)        # above the device's 227 KiB
    assert launcher._function.cache_info().currsize == 2


def test_fused_backward_rule(fake_cupy, monkeypatch):
    """launcher.fused_backward: tensor-core kernels, D_PAD <= 64, the block within the device's
    shared memory, at least FUSED["backward"] chains; TTT_CUPY_FUSE_GRADS forces it."""
    from types import SimpleNamespace

    monkeypatch.delenv(launcher.FUSE_GRADS_ENV, raising=False)
    many = launcher.FUSED["backward"]

    def problem(N, H, D, chunk_size=16):
        return SimpleNamespace(N=N, H=H, D=D, chunk_size=chunk_size)

    assert launcher.fused_backward(problem(many // 16, 16, 64), True, 0)
    assert not launcher.fused_backward(problem(many // 16 - 1, 16, 64), True, 0)
    assert not launcher.fused_backward(problem(many, 1, 64), False, 0)      # SIMT kernels
    assert not launcher.fused_backward(problem(many, 1, 100), True, 0)      # D_PAD 128
    monkeypatch.setenv(launcher.FUSE_GRADS_ENV, "1")
    assert launcher.fused_backward(problem(1, 1, 50), True, 0)
    assert not launcher.fused_backward(problem(1, 1, 100), True, 0)         # none to force
    monkeypatch.setenv(launcher.FUSE_GRADS_ENV, "0")
    assert not launcher.fused_backward(problem(many, 1, 64), True, 0)
    monkeypatch.setenv(launcher.FUSE_GRADS_ENV, "yes")
    with pytest.raises(ValueError, match=launcher.FUSE_GRADS_ENV):
        launcher.fused_backward(problem(many, 1, 64), True, 0)
    # a device with the A100's 163 KiB: D_PAD 64 at chunk 64 (175 KiB) does not fuse
    monkeypatch.delenv(launcher.FUSE_GRADS_ENV)
    launcher._device_smem_limit.cache_clear()
    sys.modules["cupy"].cuda.runtime.deviceGetAttribute = lambda attr, index: 163 * 1024
    assert cc.bwd_chain_fused_smem_bytes(64, 64) > 163 * 1024
    assert not launcher.fused_backward(problem(many, 1, 64, 64), True, 0)
    assert launcher.fused_backward(problem(many, 1, 64, 16), True, 0)
