"""No GPU needed: a training forward's backward program compiles into the disk cache in a
background thread (compile.prefetch), once per program and process, and the first use of
that program waits for it; the thread's work (diskcache.compile_into) compiles only what the
cache lacks and never raises."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from device_stand_ins import RecordingDevice

import ttt
from ttt_cupy import compile as cc
from ttt_cupy import diskcache, launcher

SPEC = dict(code="__global__ void k() {}", names=["k"], options=("-std=c++17",), arch="90")


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """compile_cubin counted, a fixed NVRTC version: no NVRTC needed."""
    calls = []

    def compile_cubin(code, names, arch, options):
        calls.append((code, tuple(names), arch, tuple(options)))
        return b"cubin bytes", {n: f"_Z{n}" for n in names}

    monkeypatch.setattr(diskcache, "compile_cubin", compile_cubin)
    monkeypatch.setattr(diskcache, "nvrtc_version", lambda: "13.0")
    return calls


def test_compile_into_stores_once(tmp_path, fake_nvrtc):
    diskcache.compile_into(tmp_path, **SPEC)
    key = diskcache.cache_key(**SPEC, nvrtc="13.0")
    path, lowered = diskcache.lookup(tmp_path, key, SPEC["names"])
    assert path.read_bytes() == b"cubin bytes" and lowered == {"k": "_Zk"}
    diskcache.compile_into(tmp_path, **SPEC)              # cached: not compiled again
    assert len(fake_nvrtc) == 1


def test_compile_into_never_raises(tmp_path, monkeypatch):
    def failing(*args):
        raise RuntimeError("NVRTC failed")

    monkeypatch.setattr(diskcache, "compile_cubin", failing)
    monkeypatch.setattr(diskcache, "nvrtc_version", lambda: "13.0")
    diskcache.compile_into(tmp_path, **SPEC)
    assert not list(tmp_path.iterdir())


@pytest.fixture
def prefetching(monkeypatch):
    """compile.prefetch with a known arch, a fresh memory of prefetches and a recording,
    slow background compile."""
    monkeypatch.setattr(cc, "device_arch", lambda index: "90")
    monkeypatch.setattr(cc, "_PREFETCHES", {})
    monkeypatch.setattr(cc, "_PREFETCHED", set())
    compiled, release = [], threading.Event()

    def compile_into_cache(*args):
        release.wait(5)
        compiled.append((args, threading.current_thread().name))

    monkeypatch.setattr(cc, "_compile_into_cache", compile_into_cache)
    return compiled, release


def test_prefetch_compiles_in_the_background_once(prefetching):
    compiled, release = prefetching
    cc.prefetch("bwd", "bfloat16", 64, 16, 0, True)
    cc.prefetch("bwd", "bfloat16", 64, 16, 0, True)        # the same program: nothing new
    cc.prefetch("bwd", "float32", 64, 16, 0, True, key=True, out="raw")
    assert compiled == []                                   # (still compiling)
    release.set()
    for args in list(cc._PREFETCHES):
        cc._prefetched(args)
    assert sorted(args for args, _ in compiled) == [
        ("bwd", "__nv_bfloat16", 64, 16, "90", True, False, "norm_residual"),
        ("bwd", "float", 64, 16, "90", False, True, "raw")]     # (float: no mma instance)
    assert {name for _, name in compiled} == {"ttt-cupy-prefetch"}
    assert cc._PREFETCHES == {}


def test_the_program_waits_for_its_prefetch(prefetching):
    compiled, release = prefetching
    cc.prefetch("bwd", "float16", 32, 16, 0, True)
    args = ("bwd", "__half", 32, 16, "90", True, False, "norm_residual")
    threading.Timer(0.2, release.set).start()
    start = time.perf_counter()
    cc._prefetched(args)                                    # what _modules does first
    assert compiled and time.perf_counter() - start >= 0.15
    cc._prefetched(args)                                    # nothing pending: returns


@pytest.mark.parametrize("key, output", [(False, "norm_residual"), (True, "raw")])
def test_a_training_forward_prefetches_its_backward(key, output):
    """The backward program of the forward's dtype, padded head dim, chunk, instances and
    variant; an inference forward asks for nothing."""
    x = torch.randn(1, 20, 2, 40)
    eta_key = torch.rand(1, 20, 2, 1) + 0.5 if key else None
    p = ttt.make_problem(x, x, x, torch.ones(2, 40), torch.zeros(2, 40), torch.rand(1, 20, 2, 1),
                         chunk_size=32, eta_key=eta_key, output=output)
    device = RecordingDevice()
    launcher.ttt_linear_fwd(p, save_for_backward=False, device=device)
    assert device.prefetches == []
    launcher.ttt_linear_fwd(p, save_for_backward=True, device=device)
    assert device.prefetches == [("bwd", "float32", 64, 32, False, key, output)]
