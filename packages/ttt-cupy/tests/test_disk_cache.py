"""No GPU needed: the disk cache of compiled programs (ttt_cupy.diskcache): its keys, atomic
writes (one valid entry after concurrent writers), a second process loading from disk
without compiling, and the fallback to CuPy's own compile whenever the cache fails."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
from conftest import LOWERED, new_process

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
    first = cc.get_kernels("fwd", "bfloat16", 64, 16, 0, True)
    assert len(fake_cupy.nvrtc) == 1 and not fake_cupy.compiles
    assert len(fake_cupy.loads) == 1
    entries = list(fake_cupy.cache_dir.glob("*.json"))
    assert len(entries) == 1
    new_process()
    again = cc.get_kernels("fwd", "bfloat16", 64, 16, 0, True)
    assert len(fake_cupy.nvrtc) == 1 and not fake_cupy.compiles     # nothing compiled
    assert len(fake_cupy.loads) == 2 and fake_cupy.loads[0] == fake_cupy.loads[1]
    assert again is not first and {k: v.name for k, v in again.items()} == \
        {k: v.name for k, v in first.items()}
    assert again["fwd_chain"].name == cc.kernel_name("fwd_chain", "__nv_bfloat16", 64, 16,
                                                     True)
    # another program (the SIMT instances, another variant) is another entry
    cc.get_kernels("fwd", "bfloat16", 64, 16, 0, False)
    cc.get_kernels("fwd", "bfloat16", 64, 16, 0, True, key=True)
    assert len(fake_cupy.nvrtc) == 3 and len(list(fake_cupy.cache_dir.glob("*.json"))) == 3


def _entry(fake_cupy):
    (meta,) = fake_cupy.cache_dir.glob("*.json")
    return meta, fake_cupy.cache_dir / json.loads(meta.read_text())["cubin"]


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
    assert len(fake_cupy.nvrtc) == 2 and not fake_cupy.compiles
    assert table["bwd_chain"].name == cc.kernel_name("bwd_chain", "float", 32, 16, False)
    new_process()                            # repaired: the next process loads it
    cc.get_kernels("bwd", "float32", 32, 16, 0, False)
    assert len(fake_cupy.nvrtc) == 2


def test_unloadable_entry_falls_back_to_cupy(fake_cupy):
    """An intact entry that the loader refuses (a driver older than the NVRTC that built
    it): CuPy compiles, without compiling with NVRTC again, in every process."""
    cc.get_kernels("bwd", "float32", 32, 16, 0, False)
    meta, cubin = _entry(fake_cupy)
    data = json.loads(meta.read_text())
    cubin.write_bytes(b"not a cubin")
    data["sha256"] = diskcache.hashlib.sha256(b"not a cubin").hexdigest()
    meta.write_text(json.dumps(data))
    for process in range(2):
        new_process()
        table = cc.get_kernels("bwd", "float32", 32, 16, 0, False)
        assert len(fake_cupy.nvrtc) == 1 and len(fake_cupy.compiles) == process + 1
        assert table["bwd_chain"].name == cc.kernel_name("bwd_chain", "float", 32, 16, False)


def _no_cuda_python(*args):
    raise ImportError("no module named cuda.bindings")


@pytest.mark.parametrize("failure", ["no-cuda-python", "nvrtc-fails", "unwritable",
                                     "load-fails"])
def test_cache_failure_falls_back_to_cupy(fake_cupy, monkeypatch, failure):
    """Whatever fails in the disk cache, CuPy compiles the program as without it."""
    if failure == "no-cuda-python":
        monkeypatch.setattr(diskcache, "nvrtc_version", _no_cuda_python)
    elif failure == "nvrtc-fails":
        monkeypatch.setattr(diskcache, "compile_cubin", _no_cuda_python)
    elif failure == "unwritable":
        blocker = fake_cupy.cache_dir.parent / "blocker"
        blocker.write_text("")
        from ttt_cupy import config as cfg
        monkeypatch.setattr(cfg, "config", lambda: CupyConfig(cache_dir=blocker / "sub"))
    else:
        def broken(path, lowered):
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
        monkeypatch.setattr(diskcache, "_load", broken)
    table = cc.get_kernels("fwd", "float32", 16, 32, 0, False)
    assert len(fake_cupy.compiles) == 1 and not fake_cupy.loads
    names = cc.pass_names("fwd", "float", 16, 32, False)
    assert sorted(fake_cupy.compiles[0]) == sorted(names.values())
    assert {k: v.name for k, v in table.items()} == names


def test_lowered_names_reach_get_function(fake_cupy):
    """The loaded module is asked for the lowered names, the table keeps name expressions."""
    cc.get_kernels("fwd", "float32", 16, 16, 0, False)
    meta, _ = _entry(fake_cupy)
    lowered = json.loads(meta.read_text())["lowered"]
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
