"""A pass's launches: the first time its key comes, every kernel but the first compiles and
loads in a thread of its own (``JITFunction.warmup``, then indexing the compiled kernel with
its grid) while the first launches; then all launch, in order. Stand-in kernels record
what happens where; the real kernels' results are the suite's (the interpreter runs the
same launches in order, compiling nothing)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ttt
from ttt_triton.ops.ttt_linear import launches
from ttt_triton.ops.ttt_linear.launches import Launch

CPU = torch.device("cpu")


def _problem():
    q = torch.randn(1, 16, 2, 16)
    return ttt.make_problem(q, q, q, torch.ones(2, 16), torch.zeros(2, 16), 0.1)


PROBLEM = _problem()


class _Kernel:
    """Records ``(event, kernel, args, kwargs, thread)``; ``warmup`` takes ``seconds``."""

    def __init__(self, name: str, log: list, seconds: float = 0.0, error: Exception | None = None):
        self.name, self.log, self.seconds, self.error = name, log, seconds, error

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("launch", self.name, grid, args, kwargs, threading.get_ident()))
        return launch

    def warmup(self, *args, grid, **kwargs):
        time.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        self.log.append(("compile", self.name, grid, args, kwargs, threading.get_ident()))
        return _Compiled(self.name, self.log)


class _Compiled:
    """What ``warmup`` returns: indexing it with a grid loads it (recorded), launching
    nothing unless the runner it returns is called."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        self.log.append(("load", self.name, grid, (), {}, threading.get_ident()))

        def launch(*args, **kwargs):
            raise AssertionError("a compiled kernel was launched while loading")
        return launch


@pytest.fixture
def on_gpu(monkeypatch):
    """As on a GPU: not interpreting; torch.cuda.device a no-op; no key seen yet."""
    monkeypatch.setattr(launches, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: _Nothing())
    monkeypatch.setattr(launches, "_SEEN", set())


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _pass(log, seconds=0.0, error=None):
    return [Launch(_Kernel("a", log), (4,), (1, 2.0), dict(X=1)),
            Launch(_Kernel("b", log, seconds), (2, 3), (3,), dict(Y=True)),
            Launch(_Kernel("c", log, seconds, error), (1, 1, 2), (), dict(Z="raw"))]


def test_a_new_key_compiles_the_others_in_threads_then_launches_in_order(on_gpu):
    log = []
    launches.run(_pass(log, seconds=0.05), CPU, "k", PROBLEM)
    me = threading.get_ident()
    compiled = [(name, grid, args, kwargs) for event, name, grid, args, kwargs, thread in log
                if event == "compile" and thread != me]
    assert sorted(compiled) == [("b", (2, 3), (3,), dict(Y=True)),
                                ("c", (1, 1, 2), (), dict(Z="raw"))]
    loaded = [(name, grid) for event, name, grid, args, kwargs, thread in log
              if event == "load" and thread != me]
    assert sorted(loaded) == [("b", (2, 3)), ("c", (1, 1, 2))]
    launched = [(name, grid, args, kwargs, thread) for event, name, grid, args, kwargs, thread
                in log if event == "launch"]
    assert launched == [("a", (4,), (1, 2.0), dict(X=1), me), ("b", (2, 3), (3,), dict(Y=True), me),
                        ("c", (1, 1, 2), (), dict(Z="raw"), me)]
    first_launch = [event for event, *_ in log].index("launch")
    assert first_launch == 0            # the first kernel launched before the others compiled


def test_a_seen_key_launches_directly(on_gpu):
    log = []
    launches.run(_pass(log), CPU, "k", PROBLEM)
    log.clear()
    launches.run(_pass(log), CPU, "k", PROBLEM)
    assert [(event, name) for event, name, *_ in log] == [("launch", "a"), ("launch", "b"),
                                                         ("launch", "c")]


def test_one_launch_and_the_interpreter_compile_nothing_ahead(on_gpu, monkeypatch):
    log = []
    launches.run(_pass(log)[:1], CPU, "one", PROBLEM)
    monkeypatch.setattr(launches, "interpreting", lambda: True)
    launches.run(_pass(log), CPU, "interpreted", PROBLEM)
    assert [event for event, *_ in log] == ["launch"] * 4


def test_a_failed_compile_raises_and_the_key_stays_new(on_gpu):
    log = []
    with pytest.raises(RuntimeError, match="no registers"):
        launches.run(_pass(log, error=RuntimeError("no registers")), CPU, "k", PROBLEM)
    assert launches._SEEN == set()
    assert [name for event, name, *_ in log if event == "launch"] == ["a"]


def test_the_memory_of_keys_is_bounded(on_gpu, monkeypatch):
    monkeypatch.setattr(launches, "MAX_KEYS", 3)
    for i in range(7):
        launches.run(_pass([]), CPU, "fwd", PROBLEM, i)
    assert len(launches._SEEN) <= 3
    assert launches.pass_key("fwd", PROBLEM, 6) in launches._SEEN
