"""A pass's launches: the first time its key comes, every kernel but the first compiles in a
thread of its own (``JITFunction.warmup``) while the first launches; then all launch, in
order, in the calling thread, which alone loads compiled kernels (Triton's driver set up
there before any thread starts). A later pass compiled ahead
(``prefetch``: the backward's, from a training forward) compiles in the background and
the first run of its kind waits for it; the launcher builds those launches as the backward
then launches them. Stand-in kernels record what happens where; the real kernels' results
are the suite's (the interpreter runs the same launches in order, compiling nothing)."""

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
    """What ``warmup`` returns: indexing it with a grid would load it (recorded; the
    launches never do it), launching nothing."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        self.log.append(("load", self.name, grid, (), {}, threading.get_ident()))

        def launch(*args, **kwargs):
            raise AssertionError("a compiled kernel was launched while loading")
        return launch


PREPARED: list[int] = []


@pytest.fixture
def on_gpu(monkeypatch):
    """As on a GPU: not interpreting; torch.cuda.device a no-op; Triton's driver setup
    recorded in ``PREPARED`` (the thread of each call); no key seen or compiled ahead yet."""
    monkeypatch.setattr(launches, "kernels_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: _Nothing())
    PREPARED.clear()
    monkeypatch.setattr(launches, "prepare_triton",
                        lambda: PREPARED.append(threading.get_ident()))
    monkeypatch.setattr(launches, "_SEEN", set())
    monkeypatch.setattr(launches, "_AHEAD", {})
    monkeypatch.setattr(launches, "_AHEAD_KEYS", set())


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
    assert not [event for event, *_ in log if event == "load"]   # threads never load
    assert PREPARED == [me]                                      # the driver, set up here
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
    monkeypatch.setattr(launches, "kernels_interpreted", lambda: True)
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


# --- compiling a later pass ahead ----------------------------------------------------------

def test_a_prefetch_compiles_in_the_background_and_the_next_run_of_its_kind_waits(on_gpu):
    log = []
    ahead_pass = [Launch(_Kernel(f"ahead {n}", log, 0.05), (1,), (), {}) for n in "abc"]
    launches.prefetch(ahead_pass, CPU, "bwd", PROBLEM, "flags")
    assert PREPARED == [threading.get_ident()]       # before its threads, in the caller
    launches.run(_pass(log)[:1], CPU, "fwd", PROBLEM)       # another kind: does not wait
    assert "bwd" in launches._AHEAD
    launches.run(_pass(log), CPU, "bwd", PROBLEM, "other flags")
    assert launches._AHEAD == {}
    me = threading.get_ident()
    bwd_launch = [i for i, (event, *_) in enumerate(log) if event == "launch"][1]
    ahead = sorted(name for event, name, *_, thread in log[:bwd_launch]
                   if event == "compile" and thread != me and name.startswith("ahead"))
    assert ahead == ["ahead a", "ahead b", "ahead c"]   # all compiled before the backward ran
    assert not [event for event, *_ in log if event == "load"]


def test_a_prefetch_runs_once_per_key_not_for_a_seen_key_nor_in_the_interpreter(on_gpu,
                                                                                monkeypatch):
    log = []
    launches.run(_pass(log), CPU, "bwd", PROBLEM, 1)
    log.clear()
    launches.prefetch(_pass(log), CPU, "bwd", PROBLEM, 1)              # seen: nothing
    launches.prefetch(_pass(log), CPU, "bwd", PROBLEM, 2)
    launches.prefetch(_pass(log), CPU, "bwd", PROBLEM, 2)              # once per key
    launches._wait_for_prefetches("bwd")
    assert sorted(name for event, name, *_ in log if event == "compile") == ["a", "b", "c"]
    monkeypatch.setattr(launches, "kernels_interpreted", lambda: True)
    assert not launches.wants_prefetch("bwd", PROBLEM, 3)


def test_the_memory_of_keys_compiled_ahead_is_bounded(on_gpu, monkeypatch):
    monkeypatch.setattr(launches, "MAX_KEYS", 3)
    for i in range(7):
        launches.prefetch(_pass([]), CPU, "bwd", PROBLEM, i)
    launches._wait_for_prefetches("bwd")
    assert len(launches._AHEAD_KEYS) <= 3
    assert launches.pass_key("bwd", PROBLEM, 6) in launches._AHEAD_KEYS


def test_a_failed_prefetch_is_left_to_the_run(on_gpu):
    log = []
    launches.prefetch(_pass(log, error=RuntimeError("no registers")), CPU, "bwd", PROBLEM, 1)
    with pytest.raises(RuntimeError, match="no registers"):
        launches.run(_pass(log, error=RuntimeError("no registers")), CPU, "bwd", PROBLEM, 1)


@pytest.fixture
def launcher_on_gpu(on_gpu, monkeypatch):
    """The Triton launcher as on a GPU with its five kernels replaced by recording stand-ins
    (``warmup`` records a compile of its arguments' dtypes and values, a launch records the
    same); returns the log."""
    from ttt_triton.ops.ttt_linear import launcher

    monkeypatch.setattr(launcher, "kernels_interpreted", lambda: False)
    monkeypatch.setattr(launcher, "_FORWARD_SETUPS", {})
    log = []
    for name in ("ttt_linear_fwd_chain_kernel", "ttt_linear_fwd_out_kernel",
                 "ttt_linear_bwd_local_kernel", "ttt_linear_bwd_chain_kernel",
                 "ttt_linear_bwd_grads_kernel"):
        monkeypatch.setattr(launcher, name, _Specialising(name, log))
    return log


def _specialisation(args: tuple) -> tuple:
    """What a compile keys on, per argument: a tensor's dtype (and an aligned address), a
    scalar's value, None."""
    return tuple(("tensor", a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else a for a in args)


class _Specialising:
    """A stand-in kernel recording ``(event, name, specialisation, kwargs)``."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("launch", self.name, _specialisation(args), kwargs))
        return launch

    def warmup(self, *args, grid, **kwargs):
        self.log.append(("compile", self.name, _specialisation(args), kwargs))
        return None


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("eta_key", [False, True])
def test_a_training_forward_compiles_its_backward_ahead_as_the_backward_launches_it(
        launcher_on_gpu, varlen, eta_key):
    """The first forward that saves for a backward compiles that backward's kernels ahead,
    with the arguments' dtypes, scalars and keyword arguments the backward then launches them
    with (so that the backward finds them compiled); later forwards compile nothing ahead."""
    from ttt_triton.ops.ttt_linear import ttt_linear_bwd, ttt_linear_fwd

    log = launcher_on_gpu
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, 2, 16, generator=g, dtype=torch.bfloat16)
    cu = torch.tensor([0, 15, 40]) if varlen else None
    p = ttt.make_problem(q, q, q, torch.ones(2, 16), torch.zeros(2, 16),
                         torch.rand(1, 40, 2, 1, generator=g), chunk_size=16, cu_seqlens=cu,
                         eta_key=torch.rand(1, 40, 2, 1, generator=g) if eta_key else None)
    _, _, _, saved = ttt_linear_fwd(p, save_for_backward=True)
    launches._wait_for_prefetches("bwd")
    ahead = sorted((name, spec, tuple(sorted(kw.items())))
                   for event, name, spec, kw in log if event == "compile" and "bwd" in name)
    assert len(ahead) == 3
    log.clear()
    ttt_linear_bwd(p, saved, torch.randn(q.shape, generator=g).to(q.dtype), None, None,
                   needs=ttt.GradNeeds(initial_state=False, initial_state_bias=False,
                                       eta_key=eta_key))
    launched = sorted((name, spec, tuple(sorted(kw.items())))
                      for event, name, spec, kw in log if event == "launch")
    assert launched == ahead
    log.clear()
    ttt_linear_fwd(p, save_for_backward=True)
    ttt_linear_fwd(p, save_for_backward=False)
    assert not any(event == "compile" and "bwd" in name for event, name, *_ in log)
