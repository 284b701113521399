"""Stand-ins of the cupy launcher's device seam for the CPU tests: a device that records
what the launcher does (:class:`RecordingDevice`), one that also runs each launch in the
kernels' CPU emulation (:class:`EmulatedDevice`), and the stand-in NVRTC's naming
(:data:`LOWERED`). Tests import them from here (conftest.py builds its fixtures on them:
a module named ``conftest`` may be another test folder's when several run together)."""

from __future__ import annotations

import contextlib
import ctypes

import torch

from ttt_cupy import compile as cc

LOWERED = "_lowered_"
"""The stand-in NVRTC's lowered name of a name expression: this prefix and the expression."""


def new_process() -> None:
    """Empty the in-memory compile caches, as a new process starts (the disk cache stays)."""
    for cache in (cc._modules, cc._kernel_table, cc.device_arch):
        cache.cache_clear()


class StandInStream:
    """A torch stream stand-in: events are recorded and waited for in name only."""

    cuda_stream = 0

    def record_event(self):
        return object()

    def wait_event(self, event) -> None:
        pass


class RecordingDevice:
    """The launcher's device seam (ttt_cupy.device.CudaDevice) on CPU tensors: an sm_90 with
    227 KiB of shared memory per block whose kernels are their name expressions. Records each
    launch as (name, grid, block, smem, params: the kernel's argument struct), each prefetch of
    a program as its arguments and each stream wait as (address, value), and keeps every
    tensor whose address a launch's struct holds (``tensors``), so that addresses stay
    theirs."""

    smem_limit = 227 * 1024
    arch = "90"

    def __init__(self):
        self.launches: list[tuple] = []
        self.prefetches: list[tuple] = []
        self.waits: list[tuple[int, int]] = []
        self.tensors: list[torch.Tensor] = []
        self.chain_stream = StandInStream()
        self.group_streams = tuple(StandInStream() for _ in range(8))

    def uses_mma(self, dtype_name: str, requested: bool) -> bool:
        return cc.use_mma(cc.CTYPES[dtype_name], self.arch, requested)

    def kernels(self, pass_: str, dtype_name: str, dp: int, bt: int, mma: bool,
                key: bool = False, out: str = "norm_residual", native_params: bool = False):
        return cc.pass_names(pass_, cc.CTYPES[dtype_name], dp, bt, mma, key, out,
                             native_params)

    def prefetch(self, pass_: str, dtype_name: str, dp: int, bt: int, mma: bool,
                 key: bool = False, out: str = "norm_residual") -> None:
        self.prefetches.append((pass_, dtype_name, dp, bt, mma, key, out))

    def active(self):
        return contextlib.nullcontext()

    def current_stream(self):
        return StandInStream()

    def wait_value(self, stream, address: int, value: int) -> bool:
        assert isinstance(stream, StandInStream)
        self.waits.append((address, value))
        return False

    def launch(self, kernel, grid, block, smem, params, stream) -> None:
        assert isinstance(stream, StandInStream)
        self.tensors.extend(params.tensors)
        self.launches.append((kernel, grid, block, smem, params))


def _entry(name: str) -> tuple[str, int, int]:
    """(emulation entry point, D_PAD, BT) of a name expression such as
    ``ttt_linear_fwd_chain<float, 64, 16, false, true>``."""
    entry, dp, bt, _ = _entry_variant(name)
    return entry, dp, bt


def _entry_variant(name: str) -> tuple[str, int, int, tuple[int, int]]:
    """_entry and the instance's variant (key, out) for ``emu_set_variant``: the template
    arguments after ``MMA`` (and fwd_chain's ``FUSE``) that compile.VARIANT_KERNELS names;
    fwd_decode's (``<T, D_PAD, KEY, OUT, P>``: no chunk size, BT 0) after D_PAD."""
    base, _, targs = name.partition("<")
    if base == f"ttt_linear_{cc.DECODE_KERNEL}":
        t, dp, *rest = (a.strip() for a in targs.rstrip(">").split(","))
        assert t == "float", f"{name}: only float instances run here"
        rest += ["false", "0", "float"][len(rest):]
        assert rest[2] == "float", name
        return f"emu_{cc.DECODE_KERNEL}", int(dp), 0, (int(rest[0] == "true"), int(rest[1]))
    t, dp, bt, mma, *rest = (a.strip() for a in targs.rstrip(">").split(","))
    assert (t, mma) == ("float", "false"), f"{name}: only float SIMT instances run here"
    kernel = base.removeprefix("ttt_linear_")
    fuse = kernel == cc.FUSED_KERNEL and rest[:1] == ["true"]
    if kernel == cc.FUSED_KERNEL:
        rest = rest[1:]
    values = dict(zip(cc.VARIANT_KERNELS[kernel], rest))
    variant = (int(values.get("KEY", "false") == "true"), int(values.get("OUT", "0")))
    return f"emu_{kernel}{'_fused' if fuse else ''}", int(dp), int(bt), variant


class EmulatedDevice(RecordingDevice):
    """The launcher's device seam with each launch run by the emulation, the tensors of the
    call registered as its arrays (prefetch hints and asynchronous copies must stay inside
    them); ``ran``: the entry points run; ``inputs``: the caller's tensors (set before)."""

    def __init__(self, emu):
        super().__init__()
        self.emu, self.ran, self.inputs = emu, [], []

    def launch(self, kernel, grid, block, smem, params, stream) -> None:
        super().launch(kernel, grid, block, smem, params, stream)
        emu = self.emu
        entry, dp, bt, variant = _entry_variant(kernel)
        emu.emu_set_variant(*variant)
        emu.emu_clear_buffers()
        for t in self.tensors + self.inputs:
            storage = t.untyped_storage()
            emu.emu_add_buffer(ctypes.c_void_p(storage.data_ptr()),
                               ctypes.c_longlong(storage.nbytes()))
        try:
            rc = getattr(emu, entry)(ctypes.c_int(dp), ctypes.c_int(bt),
                                     ctypes.c_longlong(grid), ctypes.byref(params))
        finally:
            emu.emu_set_variant(0, 0)
        assert rc == 0, f"no emulated {entry} for D_PAD {dp}, BT {bt}, variant {variant}"
        assert emu.emu_prefetch_strays() == 0, f"{entry}: prefetch hints outside its arrays"
        assert emu.emu_async_strays() == 0, f"{entry}: asynchronous copies outside its arrays"
        assert emu.emu_async_leftovers() == 0, f"{entry}: asynchronous copies never waited for"
        self.ran.append(entry)
