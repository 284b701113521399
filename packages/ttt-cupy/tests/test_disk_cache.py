"""No GPU needed: the on-disk cache of compiled programs (``compile.cached_cubin``), with
NVRTC from cuda-python compiling real cubins, and ``compile._module`` choosing it."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from ttt_cupy import compile as cc

NVRTC = cc._nvrtc_bindings()
needs_nvrtc = pytest.mark.skipif(
    NVRTC is None, reason="cuda-python's NVRTC is not installed "
                          "(pip install './packages/ttt-cupy[compile-check]')")

CODE = """
template <typename T, int N>
__global__ void add_n(T* x) { x[threadIdx.x] += T(N); }
"""
NAMES = ["add_n<float, 3>", "add_n<int, 5>"]
OPTIONS = ("-std=c++17", "-ftz=true")
ARCH = "90"


def _compiles(monkeypatch) -> list[str]:
    """Records each compile_cubin call (still compiling)."""
    calls: list[str] = []
    real = cc.compile_cubin

    def counted(code, names, options, arch, nvrtc=None):
        calls.append(arch)
        return real(code, names, options, arch, nvrtc)

    monkeypatch.setattr(cc, "compile_cubin", counted)
    return calls


@needs_nvrtc
def test_second_lookup_reads_the_cubin_from_disk(tmp_path, monkeypatch):
    calls = _compiles(monkeypatch)
    path, lowered = cc.cached_cubin(tmp_path, CODE, NAMES, OPTIONS, ARCH)
    assert calls == [ARCH]
    assert path.parent == tmp_path and path.read_bytes()[:4] == b"\x7fELF"   # a cubin
    assert set(lowered) == set(NAMES)
    assert all(low.startswith("_Z") and "add_n" in low for low in lowered.values())
    again = cc.cached_cubin(tmp_path, CODE, NAMES, OPTIONS, ARCH)
    assert again == (path, lowered) and calls == [ARCH]                 # nothing compiled
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cubin", ".json"]  # no temp files


@needs_nvrtc
@pytest.mark.parametrize("change", ["code", "names", "options", "arch"])
def test_the_key_covers_what_the_cubin_depends_on(tmp_path, monkeypatch, change):
    calls = _compiles(monkeypatch)
    first, _ = cc.cached_cubin(tmp_path, CODE, NAMES, OPTIONS, ARCH)
    args = dict(code=CODE, names=NAMES, options=OPTIONS, arch=ARCH)
    args[change] = {"code": CODE + "\n// changed\n", "names": NAMES[:1],
                    "options": ("-std=c++17",), "arch": "80"}[change]
    other, _ = cc.cached_cubin(tmp_path, args["code"], args["names"], args["options"],
                               args["arch"])
    assert other != first and len(calls) == 2


def test_the_key_covers_the_nvrtc_version():
    assert (cc.cache_key(CODE, NAMES, OPTIONS, ARCH, (13, 0))
            != cc.cache_key(CODE, NAMES, OPTIONS, ARCH, (13, 1)))


@needs_nvrtc
@pytest.mark.parametrize("damage", ["truncated cubin", "no index", "bad index"])
def test_a_damaged_entry_is_compiled_again(tmp_path, monkeypatch, damage):
    path, lowered = cc.cached_cubin(tmp_path, CODE, NAMES, OPTIONS, ARCH)
    good = path.read_bytes()
    index = path.with_suffix(".json")
    if damage == "truncated cubin":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "no index":
        index.unlink()
    else:
        index.write_text("{not json")
    calls = _compiles(monkeypatch)
    assert cc.cached_cubin(tmp_path, CODE, NAMES, OPTIONS, ARCH) == (path, lowered)
    assert calls == [ARCH] and path.read_bytes() == good


@needs_nvrtc
def test_compile_errors_carry_the_log(tmp_path):
    with pytest.raises(cc.NvrtcError, match="undefined_thing"):
        cc.cached_cubin(tmp_path, CODE + "\n__global__ void f() { undefined_thing(); }\n",
                        NAMES, OPTIONS, ARCH)
    assert not list(tmp_path.iterdir())


def test_cache_directory(monkeypatch):
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.delenv("CUPY_CACHE_DIR", raising=False)
    assert cc.disk_cache_dir() == Path("~/.cupy/kernel_cache/ttt_cupy").expanduser()
    monkeypatch.setenv("CUPY_CACHE_DIR", "/scratch/kernels")
    assert cc.disk_cache_dir() == Path("/scratch/kernels/ttt_cupy")
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    assert cc.disk_cache_dir() is None
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "0")
    monkeypatch.setenv("CUPY_CACHE_DIR", " ")
    with pytest.raises(ValueError, match="CUPY_CACHE_DIR: expected a directory"):
        cc.disk_cache_dir()


def test_unwritable_cache_directory_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "compile_cubin", lambda *a, **k: (b"cubin", {"n": "_Z1n"}))
    nvrtc = types.SimpleNamespace(nvrtcVersion=lambda: (0, 13, 0))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match="cannot create the cupy kernel cache"):
        cc.cached_cubin(blocker / "ttt_cupy", CODE, NAMES, OPTIONS, ARCH, nvrtc)


@pytest.fixture
def cupy_loading_cubins(monkeypatch, tmp_path):
    """A stand-in ``cupy`` whose RawModule loads a cubin file (``path=``) or compiles code
    with name expressions; the cache directory is ``tmp_path``."""
    made: list[dict] = []

    class RawModule:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.kwargs = kwargs

        def compile(self):
            pass

        def get_function(self, name):
            return ("kernel", name)

    cuda = types.SimpleNamespace(
        compiler=types.SimpleNamespace(CompileException=RuntimeError),
        runtime=types.SimpleNamespace(driverGetVersion=lambda: 13000))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule,
                                                                    cuda=cuda))
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    nvrtc = types.SimpleNamespace(nvrtcVersion=lambda: (0, 13, 0))
    monkeypatch.setattr(cc, "_nvrtc_bindings", lambda: nvrtc)
    cc._module.cache_clear()
    yield made
    cc._module.cache_clear()


def test_module_loads_the_cached_cubin(cupy_loading_cubins, monkeypatch, tmp_path):
    seen = {}

    def cached(directory, code, names, options, arch, nvrtc=None):
        seen.update(directory=directory, options=options, arch=arch)
        return tmp_path / "x.cubin", {n: f"lowered_{i}" for i, n in enumerate(names)}

    monkeypatch.setattr(cc, "cached_cubin", cached)
    program = cc._module("fwd", "float", 64, 16, "90", False)
    assert cupy_loading_cubins == [{"path": str(tmp_path / "x.cubin")}]
    assert seen["directory"] == tmp_path / "ttt_cupy" and seen["arch"] == "90"
    assert seen["options"][-len(cc.CACHE_OPTIONS):] == cc.CACHE_OPTIONS
    name = cc.kernel_name("fwd_out", "float", 64, 16, False)
    index = list(cc.pass_names("fwd", "float", 64, 16, False).values()).index(name)
    assert program.get_function(name) == ("kernel", f"lowered_{index}")


def test_module_falls_back_to_cupy(cupy_loading_cubins, monkeypatch):
    """Where NVRTC cannot compile (an arch it does not know) or the cache is off, CuPy
    compiles from the source in memory."""

    def fails(*args, **kwargs):
        raise cc.NvrtcError("unknown arch")

    monkeypatch.setattr(cc, "cached_cubin", fails)
    cc._module("fwd", "float", 64, 16, "120", False)
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    cc._module("bwd", "float", 64, 16, "90", False)
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY")
    monkeypatch.setattr(cc, "_nvrtc_bindings", lambda: None)            # no cuda-python
    cc._module("fwd", "float", 32, 16, "90", False)
    assert [sorted(m) for m in cupy_loading_cubins] == [["code", "name_expressions",
                                                         "options"]] * 3


def test_module_falls_back_to_cupy_on_an_older_driver(cupy_loading_cubins, monkeypatch):
    """A CUDA 12 driver does not load the cubins of NVRTC 13: CuPy compiles."""
    monkeypatch.setattr(sys.modules["cupy"].cuda.runtime, "driverGetVersion", lambda: 12080)
    monkeypatch.setattr(cc, "cached_cubin", lambda *a, **k: pytest.fail("cache used"))
    cc._module("fwd", "float", 64, 16, "90", False)
    assert sorted(cupy_loading_cubins[0]) == ["code", "name_expressions", "options"]


@needs_nvrtc
def test_a_pass_program_compiles_through_the_cache(tmp_path):
    """The options the backend adds (the CUDA headers, CACHE_OPTIONS) compile a real pass."""
    names = list(cc.pass_names("fwd", "float", 16, 16, False).values())
    options = cc.NVRTC_OPTIONS + cc.include_options() + cc.CACHE_OPTIONS
    path, lowered = cc.cached_cubin(tmp_path, cc.source("fwd"), names, options, ARCH)
    assert path.read_bytes()[:4] == b"\x7fELF" and set(lowered) == set(names)
