"""Fixtures of the cupy backend's CPU tests.

``TTT_REQUIRE_TOOLCHAIN=1`` (set by the noxfile's CPU session, as in CI): the tools the CPU
tests need (g++ for the kernels' emulation, cuda-python's NVRTC, NumPy) must be present; a
missing one is an error at session start instead of a skip. Unset or ``0``: their tests skip
with the reason.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from ttt_cupy import compile as cc
from ttt_cupy import launcher

REQUIRE_TOOLCHAIN_ENV = "TTT_REQUIRE_TOOLCHAIN"


def toolchain_required() -> bool:
    value = os.environ.get(REQUIRE_TOOLCHAIN_ENV, "0")
    if value not in ("0", "1"):
        raise pytest.UsageError(f"{REQUIRE_TOOLCHAIN_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _nvrtc_importable() -> bool:
    for name in ("cuda.bindings.nvrtc", "cuda.nvrtc"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ImportError:
            continue
    return False


def missing_toolchain() -> list[str]:
    """The tools of the CPU tests that are not here."""
    missing = []
    if shutil.which("g++") is None:
        missing.append("g++ (the CPU emulation compiles the kernels as C++20)")
    if not _nvrtc_importable():
        missing.append("cuda-python's NVRTC (pip install './packages/ttt-cupy[compile-check]')")
    if importlib.util.find_spec("numpy") is None:
        missing.append("numpy")
    return missing


def pytest_configure(config):
    if toolchain_required() and missing_toolchain():
        raise pytest.UsageError(f"{REQUIRE_TOOLCHAIN_ENV}=1, but the cupy CPU tests miss: "
                                f"{'; '.join(missing_toolchain())}")


class _Kernel:
    """A RawKernel stand-in: counts the shared-memory opt-ins."""

    def __init__(self, name: str):
        self.name = name
        self.kernel = ("function", name)
        self.optins: list[int] = []
        self._max = 48 * 1024

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        self.optins.append(value)
        self._max = value


class _Device:
    compute_capability = "90"

    def __init__(self, index: int):
        self.index = index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in ``cupy`` whose RawModule builds a new kernel object at every get_function
    (as CuPy's does); the compile caches are emptied before and after."""
    built: list[str] = []

    class RawModule:
        def __init__(self, **kwargs):
            self.names = kwargs["name_expressions"]

        def compile(self):
            pass

        def get_function(self, name):
            assert name in self.names
            built.append(name)
            return _Kernel(name)

    runtime = types.SimpleNamespace(cudaDevAttrMaxSharedMemoryPerBlockOptin=97,
                                    deviceGetAttribute=lambda attr, index: 227 * 1024)
    cuda = types.SimpleNamespace(Device=_Device, runtime=runtime,
                                 compiler=types.SimpleNamespace(CompileException=RuntimeError))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule,
                                                                    cuda=cuda))
    monkeypatch.delenv(cc.MMA_ENV, raising=False)
    caches = (cc._module, cc._kernel_table, cc.device_arch, launcher._function,
              launcher._device_smem_limit)
    for cache in caches:
        cache.cache_clear()
    yield built
    for cache in caches:  # nothing of the stand-in outlives the test
        cache.cache_clear()


class StandInStream:
    """A torch stream stand-in: events are recorded and waited for in name only."""

    cuda_stream = 0

    def record_event(self):
        return object()

    def wait_event(self, event) -> None:
        pass


@pytest.fixture
def stand_in_device(fake_cupy, monkeypatch):
    """The launcher on device 0 (the stand-in cupy's sm_90) with CPU tensors: torch's stream
    and the launcher's side streams are StandInStreams, its environment switches unset.
    Returns the stream class (launches on anything else are on a real stream)."""
    monkeypatch.setattr(launcher, "_index", lambda device: 0)
    monkeypatch.setattr(launcher, "_chain_stream", lambda index: StandInStream())
    monkeypatch.setattr(launcher, "_group_streams",
                        lambda index: tuple(StandInStream()
                                            for _ in range(launcher.GROUP_STREAMS)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StandInStream())
    for env in (launcher.FUSE_ENV, launcher.FUSE_GRADS_ENV, launcher.SEGMENT_ENV, cc.MMA_ENV,
                launcher.OVERLAP_ENV):
        monkeypatch.delenv(env, raising=False)
    return StandInStream


@pytest.fixture
def allocations(monkeypatch):
    """Every tensor torch.empty / empty_like / zeros / zeros_like made during the test, and
    every result of Tensor.to / Tensor.contiguous (the casts and copies the launcher makes of
    its inputs), kept alive, so that their addresses stay theirs."""
    made = []
    for name in ("empty", "empty_like", "zeros", "zeros_like"):
        real = getattr(torch, name)

        def wrapped(*args, _real=real, **kwargs):
            t = _real(*args, **kwargs)
            made.append(t)
            return t

        monkeypatch.setattr(torch, name, wrapped)
    for name in ("to", "contiguous"):
        real = getattr(torch.Tensor, name)

        def method(self, *args, _real=real, **kwargs):
            t = _real(self, *args, **kwargs)
            made.append(t)
            return t

        monkeypatch.setattr(torch.Tensor, name, method)
    return made


EMULATION = Path(__file__).resolve().parent / "cpu_emulation"


@pytest.fixture(scope="session")
def emu(tmp_path_factory):
    """The CPU emulation of the kernels (cpu_emulation/harness.cpp with csrc/, built with g++
    once per test process): emu_<kernel> entry points, see test_cpu_emulation.py."""
    cxx = shutil.which("g++")
    if cxx is None:
        why = "g++ not found (the CPU emulation compiles the kernels as C++20)"
        if toolchain_required():
            pytest.fail(f"{REQUIRE_TOOLCHAIN_ENV}=1: {why}")
        pytest.skip(why)
    out = tmp_path_factory.mktemp("emu") / "emu.so"
    cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", f"-I{EMULATION / 'fake_include'}",
           f"-I{cc.CSRC}", str(EMULATION / "harness.cpp"), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"the CPU emulation does not compile:\n{res.stderr[-4000:]}")
    lib = ctypes.CDLL(str(out))
    for name in ("emu_prefetches", "emu_prefetch_strays", "emu_async_copies",
                 "emu_async_strays", "emu_async_leftovers"):
        getattr(lib, name).restype = ctypes.c_longlong
    return lib
