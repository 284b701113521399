"""Fixtures of the cupy backend's CPU tests.

``TTT_REQUIRE_TOOLCHAIN=1`` (set by the noxfile's CPU session, as in CI): the tools the CPU
tests need (g++ for the kernels' emulation, cuda-python's NVRTC, NumPy) must be present; a
missing one is an error at session start instead of a skip. Unset or ``0``: their tests skip
with the reason.
"""

from __future__ import annotations

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

import pytest
from device_stand_ins import LOWERED, EmulatedDevice, RecordingDevice

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


CPU_EVIDENCE = ("test_suite_emulated.py", "test_cpu_emulation.py", "test_nvrtc_compile.py")
"""The modules that stand in for a GPU: the kernels run by the CPU emulation, every instance
compiled by NVRTC. Where the suite's tensors are on a GPU the kernels themselves run there,
so these skip (half of the cupy GPU run's CPU time); CPU CI runs them."""


def _suite_on_a_gpu(config) -> bool:
    """Whether this run's suite tensors are on a CUDA device (``--device``, else the plugin's
    default: cuda where the backend runs there and a GPU is present)."""
    import torch

    device = config.getoption("ttt_device", None)
    return device.startswith("cuda") if device else torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """The NVRTC compiles first (in their order): pytest-xdist's workers start them at once
    and run the other tests beside them, instead of ending the run on a long compile. With
    the suite on a GPU, the CPU_EVIDENCE modules skip."""
    items.sort(key=lambda item: not item.nodeid.rpartition("/")[2].startswith(NVRTC_FIRST))
    if not _suite_on_a_gpu(config):
        return
    skip = pytest.mark.skip(reason="the CPU's stand-in for a GPU (emulated kernels, every "
                                   "NVRTC instance): the suite runs the kernels on this GPU; "
                                   "CPU CI runs it")
    for item in items:
        if item.nodeid.partition("::")[0].rpartition("/")[2] in CPU_EVIDENCE:
            item.add_marker(skip)


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


@pytest.fixture
def recording():
    """A :class:`RecordingDevice` for the launcher's ``device`` argument."""
    return RecordingDevice()


@pytest.fixture
def emulated(emu):
    """An :class:`EmulatedDevice` for the launcher's ``device`` argument."""
    return EmulatedDevice(emu)
