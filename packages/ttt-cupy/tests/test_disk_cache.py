"""No GPU needed: the disk cache of compiled programs (ttt_cupy.diskcache), the backend's one
compile path: its keys, atomic writes (one valid entry after concurrent writers), a second
process loading from disk without compiling, an unwritable directory, and its failures (no
cuda-python, NVRTC, the driver) as errors that say which."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from device_stand_ins import LOWERED, new_process

from ttt_cupy import compile as cc
from ttt_cupy import diskcache
from ttt_cupy.config import CACHE_DIR_ENV, DEFAULT_CACHE_DIR, CupyConfig, cache_dir_from

NAMES = ["k<float, 16>", "k<float, 32>"]
SPEC = dict(code="__global__ void k() {}", names=NAMES, options=("-std=c++17",), arch="90",
            nvrtc="13.5")


def test_keys_differ_by_every_part():
    base = diskcache.cache_key(**SPEC)
    assert base == diskcache.cache_key(**SPEC)                      # deterministic
    others = [dict(SPEC, code=SPEC["code"] + " "), dict(SPEC, names=NAMES[:1]),
              dict(SPEC, names=NAMES[::-1]), dict(SPEC, options=("-std=c++20",)),
              dict(SPEC, options=()), dict(SPEC, arch="80"), dict(SPEC, nvrtc="13.4")]
    keys = {diskcache.cache_key(**o) for o in others}
    assert base not in keys and len(keys) == len(others)


def test_cache_dir_setting(tmp_path):
    assert CupyConfig.from_env({}).cache_dir == DEFAULT_CACHE_DIR.expanduser()
    assert cache_dir_from("") == DEFAULT_CACHE_DIR.expanduser()
    assert CupyConfig.from_env({CACHE_DIR_ENV: str(tmp_path / "c")}).cache_dir == \
        tmp_path / "c"
    assert cache_dir_from("~/x") == Path.home() / "x"
    assert cache_dir_from("rel").is_absolute()
    (tmp_path / "file").write_text("")
    for bad in (str(tmp_path / "file"), "a\0b"):
        with pytest.raises(ValueError, match=CACHE_DIR_ENV):
            CupyConfig.from_env({CACHE_DIR_ENV: bad})


def test_write_is_atomic(tmp_path, monkeypatch):
    """The target holds the old bytes or the new ones, never a part; a failed write leaves
    no temporary file."""
    target = tmp_path / "entry.json"
    diskcache.write_atomic(target, b"old")
    seen = []
    real_fsync = os.fsync

    def fsync(fd):  # the new bytes are written, not yet in place
        seen.append(target.read_bytes())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    diskcache.write_atomic(target, b"new" * 1000)
    assert seen == [b"old"] and target.read_bytes() == b"new" * 1000

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        diskcache.write_atomic(target, b"partial")
    assert target.read_bytes() == b"new" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]


def _writer(directory):
    """Store one entry again and again, each time reading back a valid one (a reader beside
    the writers never meets a partial file)."""
    for _ in range(20):
        diskcache.store(Path(directory), "k" * 64, b"\x7fELF" + bytes(range(256)) * 64,
                        {name: f"_Z0{name}" for name in NAMES})
        if diskcache.lookup(Path(directory), "k" * 64, NAMES) is None:
            return False
    return True


def test_concurrent_writers_leave_one_valid_entry(tmp_path):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert all(pool.map(_writer, [str(tmp_path)] * 8))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[1] == "k" * 64 + ".json", files   # no temporary file
    path, lowered = diskcache.lookup(tmp_path, "k" * 64, NAMES)
    assert path.read_bytes() == b"\x7fELF" + bytes(range(256)) * 64
    assert lowered == {name: f"_Z0{name}" for name in NAMES}


def test_second_process_loads_from_disk(fake_cupy):
    """Each kernel of a pass is a program and an entry of its own; a second process loads
    every one of them and compiles nothing."""
    first = cc.get_kernels("fwd", "bfloat16", 64, 16, 0, True)
    names = cc.pass_names("fwd", "__nv_bfloat16", 64, 16, True)      # (the fused chain too)
    assert sorted(fake_cupy.nvrtc) == sorted([name] for name in names.values())
    assert not fake_cupy.compiles and len(fake_cupy.loads) == len(names) == 3
    entries = list(fake_cupy.cache_dir.glob("*.json"))
    assert len(entries) == 3
    new_process()
    again = cc.get_kernels("fwd", "bfloat16", 64, 16, 0, True)
    assert len(fake_cupy.nvrtc) == 3 and not fake_cupy.compiles     # nothing compiled
    assert len(fake_cupy.loads) == 6 and sorted(fake_cupy.loads[:3]) == sorted(
        fake_cupy.loads[3:])
    assert again is not first and {k: v.name for k, v in again.items()} == \
        {k: v.name for k, v in first.items()} == names
    # other instances (SIMT, another variant) are other entries; those the same as an
    # entry's (the variant leaves fwd_out as it is) load it
    cc.get_kernels("fwd", "bfloat16", 64, 16, 0, False)
    cc.get_kernels("fwd", "bfloat16", 64, 16, 0, True, key=True)
    keyed = cc.pass_names("fwd", "__nv_bfloat16", 64, 16, True, key=True)
    simt = cc.pass_names("fwd", "__nv_bfloat16", 64, 16, False)
    distinct = {*names.values(), *keyed.values(), *simt.values()}
    assert len(fake_cupy.nvrtc) == len(distinct)
    assert len(list(fake_cupy.cache_dir.glob("*.json"))) == len(distinct)


def test_a_pass_compiles_its_kernels_side_by_side(fake_cupy, monkeypatch):
    """The programs of a pass compile at the same time, a thread each: every compile has
    started before the first one ends."""
    from ttt_cupy import diskcache

    names = list(cc.pass_names("bwd", "__nv_bfloat16", 64, 16, True).values())
    started, all_started = [], threading.Event()
    stand_in = diskcache.compile_cubin

    def compile_cubin(code, program_names, arch, options):
        started.append(threading.current_thread().name)
        if len(started) == len(names):
            all_started.set()
        assert all_started.wait(5), "the programs compiled one after another"
        return stand_in(code, program_names, arch, options)

    monkeypatch.setattr(diskcache, "compile_cubin", compile_cubin)
    table = cc.get_kernels("bwd", "bfloat16", 64, 16, 0, True)
    assert len(started) == len(names) == 4 and set(started) == {"ttt-cupy-compile"}
    assert {k: v.name for k, v in table.items()} == cc.pass_names("bwd", "__nv_bfloat16", 64,
                                                                  16, True)


def _entry(fake_cupy, kernel: str = "bwd_chain"):
    """(the .json, the cubin) of the entry holding ``kernel``'s instance."""
    for meta in fake_cupy.cache_dir.glob("*.json"):
        (name,) = json.loads(meta.read_text())["lowered"]
        if name.startswith(f"ttt_linear_{kernel}<"):
            return meta, fake_cupy.cache_dir / json.loads(meta.read_text())["cubin"]
    raise AssertionError(f"no entry for {kernel}")


@pytest.mark.parametrize("damage", ["json-truncated", "json-garbage", "json-other-names",
                                    "cubin-missing", "cubin-changed", "cubin-same-size"])
def test_corrupt_entry_compiles_again(fake_cupy, damage):
    """A damaged entry is never used: the program is compiled again (and stored again),
    the kernels are the right ones, nothing is raised."""
    cc.get_kernels("bwd", "float32", 32, 16, 0, False)
    meta, cubin = _entry(fake_cupy)
    if damage == "json-truncated":
        meta.write_bytes(meta.read_bytes()[:20])
    elif damage == "json-garbage":
        meta.write_bytes(b"\x00\xff" * 10)
    elif damage == "json-other-names":
        data = json.loads(meta.read_text())
        data["lowered"] = {"other": "x"}
        meta.write_text(json.dumps(data))
    elif damage == "cubin-missing":
        cubin.unlink()
    elif damage == "cubin-changed":
        cubin.write_bytes(cubin.read_bytes()[:-1])
    else:
        cubin.write_bytes(b"x" * len(cubin.read_bytes()))
    new_process()
    table = cc.get_kernels("bwd", "float32", 32, 16, 0, False)
    kernels = len(table)
    assert fake_cupy.nvrtc[kernels:] == [[cc.kernel_name("bwd_chain", "float", 32, 16, False)]]
    assert not fake_cupy.compiles                     # (only the damaged entry compiled)
    assert table["bwd_chain"].name == cc.kernel_name("bwd_chain", "float", 32, 16, False)
    new_process()                            # repaired: the next process loads it
    cc.get_kernels("bwd", "float32", 32, 16, 0, False)
    assert len(fake_cupy.nvrtc) == kernels + 1


def test_unloadable_entry_is_an_error(fake_cupy):
    """An intact entry that the driver refuses (a driver older than the NVRTC that built it)
    is an error that says so, in every process; nothing is compiled again."""
    cc.get_kernels("bwd", "float32", 32, 16, 0, False)
    meta, cubin = _entry(fake_cupy)
    data = json.loads(meta.read_text())
    cubin.write_bytes(b"not a cubin")
    data["sha256"] = diskcache.hashlib.sha256(b"not a cubin").hexdigest()
    meta.write_text(json.dumps(data))
    kernels = len(fake_cupy.nvrtc)
    for _ in range(2):
        new_process()
        with pytest.raises(RuntimeError, match="the CUDA driver does not load"):
            cc.get_kernels("bwd", "float32", 32, 16, 0, False)
        assert len(fake_cupy.nvrtc) == kernels and not fake_cupy.compiles


def _no_cuda_python(*args):
    raise ImportError("no module named cuda.bindings")


def _nvrtc_fails(*args):
    raise diskcache.NvrtcError("nvrtcCompileProgram: NVRTC_ERROR_COMPILATION\nthe log")


@pytest.mark.parametrize("failure", ["no-cuda-python", "nvrtc-fails", "load-fails"])
def test_compile_failure_is_an_error(fake_cupy, monkeypatch, failure):
    """NVRTC through cuda-python is the one compile path: without cuda-python, when NVRTC
    fails or the driver refuses the cubin, a RuntimeError that says which (NVRTC's log);
    CuPy compiles nothing."""
    match = "NVRTC could not compile"
    if failure == "no-cuda-python":
        monkeypatch.setattr(diskcache, "nvrtc_version", _no_cuda_python)
    elif failure == "nvrtc-fails":
        monkeypatch.setattr(diskcache, "compile_cubin", _nvrtc_fails)
        match = "the log"
    else:
        def broken(path, lowered):
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
        monkeypatch.setattr(diskcache, "_load", broken)
        match = "CUDA_ERROR_INVALID_IMAGE"
    with pytest.raises(RuntimeError, match=match):
        cc.get_kernels("fwd", "float32", 16, 32, 0, False)
    assert not fake_cupy.compiles


def test_unwritable_cache_loads_from_a_temporary_file(fake_cupy, monkeypatch):
    """A cache directory that cannot be written: each program compiles with NVRTC and loads
    from a temporary file (gone afterwards); nothing is stored, CuPy compiles nothing."""
    blocker = fake_cupy.cache_dir.parent / "blocker"
    blocker.write_text("")
    from ttt_cupy import config as cfg
    monkeypatch.setattr(cfg, "config", lambda: CupyConfig(cache_dir=blocker / "sub"))
    table = cc.get_kernels("fwd", "float32", 16, 32, 0, False)
    names = cc.pass_names("fwd", "float", 16, 32, False)
    assert {n for [n] in fake_cupy.nvrtc} == set(names.values()) and not fake_cupy.compiles
    assert len(fake_cupy.loads) == len(names)
    assert not any(os.path.exists(path) for path in fake_cupy.loads)
    assert {k: v.name for k, v in table.items()} == names


def test_lowered_names_reach_get_function(fake_cupy):
    """The loaded module is asked for the lowered names, the table keeps name expressions."""
    cc.get_kernels("fwd", "float32", 16, 16, 0, False)
    lowered = {}
    for meta in fake_cupy.cache_dir.glob("*.json"):
        lowered.update(json.loads(meta.read_text())["lowered"])
    assert lowered == {n: LOWERED + n for n in cc.pass_names("fwd", "float", 16, 16,
                                                             False).values()}


def test_nvrtc_cubin_and_lowered_names(tmp_path):
    """cuda-python's NVRTC (no GPU): a cubin for sm_90 and the mangled names of a templated
    kernel, stored and found again."""
    pytest.importorskip("numpy")
    try:
        version = diskcache.nvrtc_version()
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"cuda-python's NVRTC: {err}")
    code = ("template <typename T, int N> __global__ void twice(T* x) "
            "{ x[threadIdx.x % N] *= 2; }\n")
    names = ["twice<float, 4>", "twice<double, 8>"]
    cubin, lowered = diskcache.compile_cubin(code, names, "90", ("-std=c++17",))
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 100
    assert set(lowered) == set(names)
    assert all(low.startswith("_Z") and "twice" in low for low in lowered.values())
    assert len(set(lowered.values())) == 2
    key = diskcache.cache_key(code, names, ("-std=c++17",), "90", version)
    path = diskcache.store(tmp_path, key, cubin, lowered)
    assert diskcache.lookup(tmp_path, key, names) == (path, lowered)
    assert diskcache.lookup(tmp_path, key, names[:1]) is None


_EXIT_DURING_PREFETCH = """
import sys, time
from ttt_cupy import compile as cc
cc.device_arch = lambda index: "90"          # no GPU here: the arch the cubins are for
cc.prefetch("bwd", "bfloat16", 64, 16, 0, True)
time.sleep(0.5)                              # the programs' threads are in NVRTC
sys.exit(0)                                  # while they compile (about 2 s)
"""


def test_a_process_ending_during_a_prefetch_waits_for_it(tmp_path):
    """A process that ends while its backward's programs compile in the background (a
    forward with gradients, no backward) exits cleanly once they are in the cache: a thread
    stopped inside NVRTC at interpreter exit crashed the process."""
    pytest.importorskip("numpy")
    try:
        diskcache.nvrtc_version()
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"cuda-python's NVRTC: {err}")
    env = dict(os.environ, **{CACHE_DIR_ENV: str(tmp_path)})
    done = subprocess.run([sys.executable, "-c", _EXIT_DURING_PREFETCH], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    entries = list(tmp_path.glob("*.json"))
    assert len(entries) == len(cc.pass_names("bwd", "__nv_bfloat16", 64, 16, True)) == 4
