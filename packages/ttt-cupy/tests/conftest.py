"""Fixtures of the cupy backend's CPU tests.

``TTT_REQUIRE_TOOLCHAIN=1`` (set by the noxfile's CPU session, as in CI): the tools the CPU
tests need (g++ for the kernels' emulation, cuda-python's NVRTC, NumPy) must be present; a
missing one is an error at session start instead of a skip. Unset or ``0``: their tests skip
with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from ttt_cupy import compile as cc

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


NVRTC_FIRST = ("test_nvrtc_compile.py::test_every_instance_compiles[",
               "test_nvrtc_compile.py::test_variant_instances_compile[")
"""The NVRTC compiles: most of a CPU run's time, in parts of up to two minutes."""


def pytest_collection_modifyitems(items):
    """The NVRTC compiles first (in their order): pytest-xdist's workers start them at once
    and run the other tests beside them, instead of ending the run on a long compile."""
    items.sort(key=lambda item: not item.nodeid.rpartition("/")[2].startswith(NVRTC_FIRST))


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


class FakeCupyLog(list):
    """What the stand-in ``cupy`` did: the list holds the kernel objects' names built by
    ``get_function``; ``compiles`` the name expressions of each program compiled by CuPy
    (``RawModule(code=...)``), ``nvrtc`` those compiled to a cubin for the disk cache
    (``diskcache.compile_cubin``), ``loads`` the cubin paths loaded
    (``RawModule(path=...)``); ``cache_dir`` the disk cache's directory."""

    def __init__(self, cache_dir: Path):
        super().__init__()
        self.compiles: list[list[str]] = []
        self.nvrtc: list[list[str]] = []
        self.loads: list[str] = []
        self.cache_dir = cache_dir


LOWERED = "_lowered_"
"""The stand-in NVRTC's lowered name of a name expression: this prefix and the expression."""


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path):
    """A stand-in ``cupy`` whose RawModule builds a new kernel object at every get_function
    (as CuPy's does), and a stand-in NVRTC for the disk cache (``diskcache.compile_cubin``:
    a "cubin" listing the lowered names) with its directory under ``tmp_path``; the compile
    caches are emptied before and after."""
    from ttt_cupy import config as cfg
    from ttt_cupy import diskcache

    built = FakeCupyLog(tmp_path / "cupy-cache")

    class RawModule:
        def __init__(self, code=None, options=(), name_expressions=None, path=None):
            if path is not None:
                data = json.loads(Path(path).read_text())    # (a corrupt cubin raises here)
                self.names = [LOWERED + name for name in data]
                built.loads.append(path)
            else:
                self.names = name_expressions
                self.code = code

        def compile(self):
            built.compiles.append(list(self.names))

        def get_function(self, name):
            assert name in self.names
            name = name.removeprefix(LOWERED)
            built.append(name)
            return _Kernel(name)

    def compile_cubin(code, names, arch, options):
        built.nvrtc.append(list(names))
        return json.dumps(sorted(names)).encode(), {name: LOWERED + name for name in names}

    runtime = types.SimpleNamespace(cudaDevAttrMaxSharedMemoryPerBlockOptin=97,
                                    deviceGetAttribute=lambda attr, index: 227 * 1024)
    cuda = types.SimpleNamespace(Device=_Device, runtime=runtime,
                                 compiler=types.SimpleNamespace(CompileException=RuntimeError))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule,
                                                                    cuda=cuda))
    monkeypatch.setattr(diskcache, "compile_cubin", compile_cubin)
    monkeypatch.setattr(diskcache, "nvrtc_version", lambda: "0.0-stand-in")
    monkeypatch.setenv(cfg.CACHE_DIR_ENV, str(built.cache_dir))
    caches = (cc._modules, cc._kernel_table, cc.device_arch, cfg.config)
    for cache in caches:
        cache.cache_clear()
    yield built
    for cache in caches:  # nothing of the stand-in outlives the test
        cache.cache_clear()


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
    launch as (name, grid, block, smem, args), each prefetch of a program as its arguments and
    each stream wait as (address, value), and
    keeps every tensor whose address the launcher took (``tensors``), so that addresses stay
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

    def pointer(self, t):
        if t is not None:
            self.tensors.append(t)
        return np.uint64(0 if t is None else t.data_ptr())

    def current_stream(self):
        return StandInStream()

    def wait_value(self, stream, address: int, value: int) -> bool:
        assert isinstance(stream, StandInStream)
        self.waits.append((address, value))
        return False

    def launch(self, kernel, grid, block, smem, args, stream) -> None:
        assert isinstance(stream, StandInStream)
        self.launches.append((kernel, grid, block, smem, args))


EMULATION = Path(__file__).resolve().parent / "cpu_emulation"


EMULATION_PARTS = 2
"""The translation units of the emulation's build (harness.cpp's EMU_PART), compiled at once."""


def _build_emulation(cxx: str, out: Path) -> None:
    """harness.cpp to the shared library ``out``: its parts compiled by concurrent g++
    processes (the test run's workers wait for the build), then linked."""
    flags = ["-std=c++20", "-O1", "-fPIC", f"-I{EMULATION / 'fake_include'}", f"-I{cc.CSRC}"]
    objects = [out.with_suffix(f".{os.getpid()}.part{i}.o") for i in range(EMULATION_PARTS)]
    compiles = [subprocess.Popen([cxx, *flags, f"-DEMU_PART={i}", "-c",
                                  str(EMULATION / "harness.cpp"), "-o", str(obj)],
                                 stderr=subprocess.PIPE, text=True)
                for i, obj in enumerate(objects)]
    errors = [err for proc in compiles for _, err in [proc.communicate()] if proc.returncode]
    if errors:
        pytest.fail(f"the CPU emulation does not compile:\n{errors[0][-4000:]}")
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    res = subprocess.run([cxx, "-shared", *map(str, objects), "-o", str(partial)],
                         capture_output=True, text=True)
    for obj in objects:
        obj.unlink()
    if res.returncode != 0:
        pytest.fail(f"the CPU emulation does not link:\n{res.stderr[-4000:]}")
    os.replace(partial, out)


@pytest.fixture(scope="session")
def emu(tmp_path_factory):
    """The CPU emulation of the kernels (cpu_emulation/harness.cpp with csrc/, built with g++
    once per test run: the pytest-xdist workers of a run share one build, made by the first
    under a file lock): emu_<kernel> entry points, see test_cpu_emulation.py."""
    cxx = shutil.which("g++")
    if cxx is None:
        why = "g++ not found (the CPU emulation compiles the kernels as C++20)"
        if toolchain_required():
            pytest.fail(f"{REQUIRE_TOOLCHAIN_ENV}=1: {why}")
        pytest.skip(why)
    sources = sorted([*EMULATION.rglob("*.cpp"), *EMULATION.rglob("*.h"),
                      *Path(cc.CSRC).iterdir()])
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()[:16]
    shared = tmp_path_factory.getbasetemp().parent      # (one per run, every worker's)
    out = shared / f"emu-{digest}.so"
    with open(shared / f"emu-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            _build_emulation(cxx, out)
    lib = ctypes.CDLL(str(out))
    for name in ("emu_prefetches", "emu_prefetch_strays", "emu_async_copies",
                 "emu_async_strays", "emu_async_leftovers"):
        getattr(lib, name).restype = ctypes.c_longlong
    return lib


_C = {np.uint64: ctypes.c_void_p, np.float32: ctypes.c_float, np.int32: ctypes.c_int,
      np.int64: ctypes.c_longlong}


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

    def launch(self, kernel, grid, block, smem, args, stream) -> None:
        super().launch(kernel, grid, block, smem, args, stream)
        emu = self.emu
        entry, dp, bt, variant = _entry_variant(kernel)
        emu.emu_set_variant(*variant)
        emu.emu_clear_buffers()
        for t in self.tensors + self.inputs:
            storage = t.untyped_storage()
            emu.emu_add_buffer(ctypes.c_void_p(storage.data_ptr()),
                               ctypes.c_longlong(storage.nbytes()))
        c_args = [_C[type(a)](float(a) if isinstance(a, np.floating) else int(a))
                  for a in args[:-1]]                    # (the last: the smem size)
        try:
            rc = getattr(emu, entry)(ctypes.c_int(dp), ctypes.c_int(bt),
                                     ctypes.c_longlong(grid), *c_args)
        finally:
            emu.emu_set_variant(0, 0)
        assert rc == 0, f"no emulated {entry} for D_PAD {dp}, BT {bt}, variant {variant}"
        assert emu.emu_prefetch_strays() == 0, f"{entry}: prefetch hints outside its arrays"
        assert emu.emu_async_strays() == 0, f"{entry}: asynchronous copies outside its arrays"
        assert emu.emu_async_leftovers() == 0, f"{entry}: asynchronous copies never waited for"
        self.ran.append(entry)


@pytest.fixture
def recording():
    """A :class:`RecordingDevice` for the launcher's ``device`` argument."""
    return RecordingDevice()


@pytest.fixture
def emulated(emu):
    """An :class:`EmulatedDevice` for the launcher's ``device`` argument."""
    return EmulatedDevice(emu)
