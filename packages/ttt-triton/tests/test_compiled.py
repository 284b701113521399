"""Launches through compiled kernels (``compiled.launch``): the first launch of a key goes
through ``kernel[grid]`` (``JITFunction.run``), later ones call the compiled kernel's
launcher with every parameter in order; a launch key tells apart whatever Triton's own
specialisation key does. Stand-in kernels record the calls; the real launches run in the
GPU suite."""

from __future__ import annotations

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend

from ttt_triton.ops.ttt_linear import compiled


def _kernel_fn(x, y, n, s, H: int, D: int = 64, OUT: str = "raw"):
    """The stand-in's parameters: three runtime ones, then constexprs (one defaulted)."""


class _Kernel:
    """``kernel[grid](*args, **kwargs)`` records a run and returns a :class:`_Compiled`."""

    fn = staticmethod(_kernel_fn)

    def __init__(self, log: list):
        self.log = log

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("run", grid, args, kwargs))
            return _Compiled(self.log)
        return run


class _Compiled:
    def __init__(self, log: list):
        self.log = log

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.log.append(("runner", grid, args, stream))
        return runner


@pytest.fixture
def log(monkeypatch):
    monkeypatch.setattr(compiled, "_RUNNERS", {})
    monkeypatch.setattr(compiled, "current_device", lambda: 0)
    return []


def _args(x=None, y=None, n=16, s=0.5):
    x = torch.randn(8) if x is None else x
    return (x, y, n, s)


def test_a_seen_key_calls_the_compiled_launcher_with_every_parameter_in_order(log):
    """In parameter order, defaults filled in; a tensor as its address."""
    kernel, x = _Kernel(log), torch.randn(8)
    kwargs = dict(H=4, OUT="query_residual", num_warps=4)
    compiled.launch(kernel, (6,), _args(x), kwargs)
    compiled.launch(kernel, (6,), _args(x, s=0.25), kwargs)
    assert log == [("run", (6,), (x, None, 16, 0.5), kwargs),
                   ("runner", (6, 1, 1), (x.data_ptr(), None, 16, 0.25, 4, 64,
                                          "query_residual"), None)]


@pytest.mark.parametrize("change", ["dtype", "alignment", "int", "none", "constexpr",
                                    "option", "grid", "device", "kernel"])
def test_what_a_launch_key_tells_apart_launches_through_run_again(log, monkeypatch, change):
    kernel, x = _Kernel(log), torch.randn(8)
    kwargs = dict(H=4, num_warps=4)
    compiled.launch(kernel, (6,), _args(x), kwargs)
    args, grid = _args(x), (6,)
    if change == "dtype":
        args = _args(x.double())
    elif change == "alignment":
        args = _args(torch.randn(9)[1:])
    elif change == "int":
        args = _args(x, n=17)
    elif change == "none":
        args = _args(x, y=x)
    elif change == "constexpr":
        kwargs = dict(kwargs, H=8)
    elif change == "option":
        kwargs = dict(kwargs, num_warps=8)
    elif change == "grid":
        grid = (7,)
    elif change == "device":
        monkeypatch.setattr(compiled, "current_device", lambda: 1)
    elif change == "kernel":
        kernel = _Kernel(log)
    compiled.launch(kernel, grid, args, kwargs)
    assert [event[0] for event in log] == ["run", "run"]


def test_the_kept_keys_are_bounded(log, monkeypatch):
    monkeypatch.setattr(compiled, "MAX_KEYS", 2)
    kernel = _Kernel(log)
    for n in (1, 2, 3, 1):
        compiled.launch(kernel, (1,), _args(n=n), {})
    assert [event[0] for event in log] == ["run"] * 4
    assert len(compiled._RUNNERS) == 2


VALUES = [None, True, False, 1, 2, 16, 17, 32, -16, 2**31 - 16, 2**31, 2**32 + 16, 1.0, 0.5,
          torch.empty(8), torch.empty(9)[1:], torch.empty(8, dtype=torch.bfloat16),
          torch.empty(16, dtype=torch.float16)[8:], torch.empty(4, dtype=torch.int32)]


def test_equal_launch_keys_mean_equal_triton_specialisations(log):
    """Over pairs of argument values: where the launch keys agree, so does Triton's
    specialisation of the argument (the installed Triton's own function)."""
    kernel = _Kernel(log)
    for a, b in itertools.product(VALUES, repeat=2):
        if compiled.launch_key(kernel, (1,), (a,), {}) == compiled.launch_key(
                kernel, (1,), (b,), {}):
            assert (native_specialize_impl(CUDABackend, a, False, True, True)
                    == native_specialize_impl(CUDABackend, b, False, True, True)), (a, b)


class _Loaded(_Compiled):
    """A loaded ``CompiledKernel``'s stand-in: its launcher, function handle and packed
    metadata too."""

    function, packed_metadata = "function", "metadata"

    def run(self, *args):
        self.log.append(("launcher", args))


class _LoadedKernel(_Kernel):
    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("run", grid, args, kwargs))
            return _Loaded(self.log)
        return run


@pytest.fixture
def direct(log, monkeypatch):
    monkeypatch.setattr(compiled, "stream_query", lambda: lambda device: 1000 + device)
    return log


def test_without_hooks_a_seen_key_calls_the_launcher_itself(direct):
    """On the current stream, with no launch metadata and no hooks, then every parameter in
    order (a tensor as its address)."""
    kernel, x = _LoadedKernel(direct), torch.randn(8)
    kwargs = dict(H=4, num_warps=4)
    compiled.launch(kernel, (6, 2), _args(x), kwargs)
    compiled.launch(kernel, (6, 2), _args(x, s=0.25), kwargs)
    assert direct[1:] == [("launcher", (6, 2, 1, 1000, "function", "metadata", None, None,
                                        None, x.data_ptr(), None, 16, 0.25, 4, 64, "raw"))]


def test_with_a_launch_hook_every_launch_goes_through_tritons_runner(direct):
    from triton import knobs

    kernel, x = _LoadedKernel(direct), torch.randn(8)
    compiled.launch(kernel, (6,), _args(x), {"H": 4})
    seen = []
    for chain in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(knobs.runtime, chain)
        hook.add(seen.append)
        try:
            compiled.launch(kernel, (6,), _args(x), {"H": 4})
        finally:
            hook.remove(seen.append)
    compiled.launch(kernel, (6,), _args(x), {"H": 4})
    assert [event[0] for event in direct] == ["run", "runner", "runner", "launcher"]


def test_a_triton_without_knobs_launches_through_the_runner(direct, monkeypatch):
    monkeypatch.setattr(compiled, "launch_hooks", lambda: None)
    kernel, x = _LoadedKernel(direct), torch.randn(8)
    for _ in range(2):
        compiled.launch(kernel, (6,), _args(x), {"H": 4})
    assert [event[0] for event in direct] == ["run", "runner"]
