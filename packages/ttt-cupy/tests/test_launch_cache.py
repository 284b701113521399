"""No GPU needed: the host-side caches of the cupy backend, with a stand-in ``cupy`` module.

``compile.get_kernels`` must hand out one table per (pass, dtype, D_PAD, BT, device, mma), the
same kernel objects at every call: CuPy's ``RawModule.get_function`` builds a new RawKernel
each time it is asked, and ``CudaDevice.function`` (the launch path's CUDA function, opted in
to its shared memory once) is keyed by the kernel object, so new objects per call would grow
it without bound over a training run.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from ttt_cupy import compile as cc
from ttt_cupy.config import Schedule
from ttt_cupy.device import CudaDevice
from ttt_cupy.placement import FUSED, fused_backward


def test_kernel_table_is_built_once(fake_cupy):
    first = cc.get_kernels("bwd", "bfloat16", 64, 16, 0, True)
    assert set(first) == {*cc.PASSES["bwd"], cc.FUSED_BWD_NAME}   # (the fused chain: D_PAD 64)
    assert len(fake_cupy) == 4
    for _ in range(5):
        again = cc.get_kernels("bwd", "bfloat16", 64, 16, 0, True)
        assert again is first and again["bwd_chain"] is first["bwd_chain"]
    assert len(fake_cupy) == 4                          # no kernel object built per call
    with pytest.raises(TypeError):
        first["bwd_chain"] = None                        # read-only: one table for everyone
    # the tensor-core instances for half inputs; mma False gives another table, of the SIMT
    # instances
    assert first["bwd_chain"].name == cc.kernel_name("bwd_chain", "__nv_bfloat16", 64, 16, True)
    simt = cc.get_kernels("bwd", "bfloat16", 64, 16, 0, False)
    assert simt is not first
    assert simt["bwd_chain"].name == cc.kernel_name("bwd_chain", "__nv_bfloat16", 64, 16, False)
    assert cc.FUSED_BWD_NAME not in simt                   # tensor-core instances only
    forward = cc.get_kernels("fwd", "float32", 32, 16, 1, True)  # another pass and device
    assert set(forward) == {*cc.PASSES["fwd"], cc.FUSED_NAME}
    assert cc.get_kernels("fwd", "float32", 32, 16, 1, False) is forward  # (float: SIMT)


def test_decode_table_is_one_for_every_chunk_size(fake_cupy):
    """The ``dec`` pass (fwd_decode: no chunk size, no tensor-core instance) has one table per
    (dtype, D_PAD, device, variant), whatever BT and mma a call names: one program, one
    kernel object."""
    first = cc.get_kernels("dec", "bfloat16", 64, 16, 0, True)
    assert set(first) == {cc.DECODE_KERNEL} and len(fake_cupy) == 1
    assert first[cc.DECODE_KERNEL].name == cc.decode_name("__nv_bfloat16", 64)
    for bt in (16, 32, 64):
        for mma in (False, True):
            assert cc.get_kernels("dec", "bfloat16", 64, bt, 0, mma) is first
    assert len(fake_cupy) == 1 and len(fake_cupy.nvrtc) == 1
    variant = cc.get_kernels("dec", "bfloat16", 64, 16, 0, True, key=True, out="raw")
    assert variant[cc.DECODE_KERNEL].name == cc.decode_name("__nv_bfloat16", 64, True, "raw")


def test_function_opts_in_once(fake_cupy):
    kernel = cc.get_kernels("fwd", "bfloat16", 64, 16, 0, True)["fwd_out"]
    device = CudaDevice(0)
    for _ in range(3):
        assert device.function(kernel, 100_000) == kernel.kernel
    assert kernel.optins == [100_000]                   # asked once, not at every launch
    device.function(kernel, 1024)                        # below the opt-in: nothing to ask
    assert kernel.optins == [100_000]
    with pytest.raises(RuntimeError, match="shared memory"):
        device.function(kernel, 228 * 1024)              # above the device's 227 KiB
    assert device.function(kernel, 1024) == kernel.kernel


def test_fused_backward_rule():
    """placement.fused_backward: tensor-core kernels, D_PAD <= 64, the block within the
    device's shared memory, at least FUSED.backward chains; Schedule.fuse_backward forces
    it where it exists."""
    many, h200, a100 = FUSED.backward, 227 * 1024, 163 * 1024
    on, off = Schedule(fuse_backward=True), Schedule(fuse_backward=False)

    def problem(N, H, D, chunk_size=16):
        return SimpleNamespace(N=N, H=H, D=D, chunk_size=chunk_size)

    assert fused_backward(problem(many // 16, 16, 64), True, h200)
    assert not fused_backward(problem(many // 16 - 1, 16, 64), True, h200)
    assert not fused_backward(problem(many, 1, 64), False, h200)      # SIMT kernels
    assert not fused_backward(problem(many, 1, 100), True, h200)      # D_PAD 128
    assert fused_backward(problem(1, 1, 50), True, h200, on)
    assert not fused_backward(problem(1, 1, 100), True, h200, on)     # none to force
    assert not fused_backward(problem(many, 1, 64), True, h200, off)
    # a device with the A100's 163 KiB: D_PAD 64 at chunk 64 (175 KiB) does not fuse
    assert not fused_backward(problem(many, 1, 64, 64), True, a100)
    assert fused_backward(problem(many, 1, 64, 16), True, a100)


def test_device_smem_limit(fake_cupy):
    assert CudaDevice(0).smem_limit == 227 * 1024
    sys.modules["cupy"].cuda.runtime.deviceGetAttribute = lambda attr, index: 163 * 1024
    assert CudaDevice(1).smem_limit == 163 * 1024
