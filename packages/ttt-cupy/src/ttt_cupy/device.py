"""The CUDA device as the launcher sees it (kernels, streams, stream waits, launches): one
object, :class:`CudaDevice`, the launcher's one seam, for which tests pass stand-ins."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping
from typing import Any

import torch

from .compile import CTYPES, device_arch, get_kernels, prefetch, use_mma


def device_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def max_smem_optin(device: torch.device) -> int | None:
    """The device's opt-in shared memory per block in bytes (None when torch does not say)."""
    return _max_smem_optin(device_index(device))


@functools.cache
def _max_smem_optin(index: int) -> int | None:
    value = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin",
                    None)
    return int(value) if value else None


class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._ptr)


@functools.cache
def _cu_stream_wait_value32():
    """The driver's ``cuStreamWaitValue32`` through ctypes (neither torch nor CuPy has it), or
    None where libcuda or the function is missing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(lib, "cuStreamWaitValue32",
                                                                  None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=256)
def _cupy_stream(ptr: int, index: int):
    """CuPy's view of torch's stream ``ptr`` (``Stream.from_external``, else the
    ``ExternalStream`` that CuPy 14 deprecates)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, index)


GROUP_STREAMS = 8
"""Side streams for segmented passes' group kernels (round robin), which one stream would queue."""


class CudaDevice:
    """CUDA device ``index`` through CuPy (kernels) and torch (streams)."""

    def __init__(self, index: int):
        self.index = index
        self._functions: dict[tuple[Any, int], Any] = {}

    @functools.cached_property
    def smem_limit(self) -> int:
        """Opt-in dynamic shared memory per block, bytes."""
        import cupy

        runtime = cupy.cuda.runtime
        attr = getattr(runtime, "cudaDevAttrMaxSharedMemoryPerBlockOptin", 97)
        return int(runtime.deviceGetAttribute(attr, self.index))

    def uses_mma(self, dtype_name: str, requested: bool) -> bool:
        return use_mma(CTYPES[dtype_name], device_arch(self.index), requested)

    def kernels(self, pass_: str, dtype_name: str, dp: int, bt: int, mma: bool,
                **variant) -> Mapping[str, Any]:
        """:func:`~ttt_cupy.compile.get_kernels` on this device (``variant``: key, out,
        native_params)."""
        return get_kernels(pass_, dtype_name, dp, bt, self.index, mma, **variant)

    def prefetch(self, pass_: str, dtype_name: str, dp: int, bt: int, mma: bool,
                 **variant) -> None:
        prefetch(pass_, dtype_name, dp, bt, self.index, mma, **variant)

    def active(self):
        """A context holding this device current in CuPy."""
        import cupy

        return cupy.cuda.Device(self.index)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.index)

    @functools.cached_property
    def chain_stream(self) -> torch.cuda.Stream:
        """The high-priority side stream of segmented and overlapped chains."""
        return torch.cuda.Stream(device=self.index, priority=-1)

    @functools.cached_property
    def group_streams(self) -> tuple[torch.cuda.Stream, ...]:
        return tuple(torch.cuda.Stream(device=self.index) for _ in range(GROUP_STREAMS))

    def wait_value(self, stream, address: int, value: int) -> bool:
        """Make ``stream`` wait until the int32 at ``address`` is at least ``value``
        (``CU_STREAM_WAIT_VALUE_GEQ``); False where the driver cannot (nothing enqueued)."""
        fn = _cu_stream_wait_value32()
        return fn is not None and fn(stream.cuda_stream, address, value, 0) == 0

    def function(self, kernel, smem: int):
        """``kernel``'s CuPy ``Function``, opted in to ``smem`` bytes once per (kernel, size)."""
        key = (kernel, smem)
        fn = self._functions.get(key)
        if fn is None:
            if smem > self.smem_limit:
                raise RuntimeError(f"the cupy kernel needs {smem} bytes of shared memory; the "
                                   f"device allows {self.smem_limit} per block")
            with self.active():
                if kernel.max_dynamic_shared_size_bytes < smem:
                    kernel.max_dynamic_shared_size_bytes = smem
            fn = self._functions[key] = kernel.kernel
        return fn

    def launch(self, kernel, grid: int, block: int, smem: int, params, stream) -> None:
        """Launch ``kernel`` on ``stream`` with its argument struct ``params``
        (:class:`ttt_cupy.params.Params`); the caller holds the device :meth:`active`."""
        if grid == 0:
            return
        self.function(kernel, smem)((grid,), (block,), (params.as_numpy(),), shared_mem=smem,
                                    stream=_cupy_stream(stream.cuda_stream, self.index))


_cuda_device = functools.cache(CudaDevice)


def cuda_device(device: torch.device) -> CudaDevice:
    """The :class:`CudaDevice` of a torch device (one per index per process)."""
    return _cuda_device(device_index(device))
