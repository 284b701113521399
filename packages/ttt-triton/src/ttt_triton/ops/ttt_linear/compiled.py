"""Launching a kernel's compiled specialisation directly, once it is known.

``kernel[grid](*args, **kwargs)`` (``JITFunction.run``) binds the arguments, builds Triton's
specialisation key, looks the compiled kernel up and launches it: tens of microseconds of
host time per launch of one of these kernels (about 20 runtime arguments, 15 constexprs).
Triton's key is a function of what :func:`launch_key` reads, which is cheaper to build:

- each tensor's dtype and whether its address is a multiple of 16 (Triton: ``*bf16``
  with or without the ``D`` divisibility attribute);
- each other runtime argument's type and value (Triton: floats by type alone, ints by
  value class, ``None`` as a constant; the value itself is finer);
- the kernel, the constexprs and compiler options (``kwargs``), the grid and the device.

The first launch of a key goes through ``JITFunction.run``, which compiles if needed and
returns the compiled kernel; later launches of that key call its launcher
(``CompiledKernel[grid](*arguments)``, the call ``JITFunction.run`` ends in, launch hooks
included) with the arguments in the kernel's parameter order, each tensor as its address:
the launcher takes an int pointer as it is, where for a tensor it calls ``data_ptr`` and
asks the driver whether the address is a device pointer (the core has checked the device).
That launcher, with no launch hook set (``triton.knobs.runtime.launch_enter_hook`` /
``launch_exit_hook``, which profilers such as proton set), is called without Triton's Python
wrapper around it: on the current stream, with no launch metadata and no hooks, as the
wrapper would call it then but for the metadata it builds and the empty hook chains it calls
on every launch (Triton 3.6). With a hook set, or a Triton without ``triton.knobs``, every
launch goes through the wrapper. In Triton's interpreter every launch goes through
``JITFunction.run``.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

MAX_KEYS = 1024
"""Launch keys kept; past this many they are all forgotten (the next launches take
``JITFunction.run`` once more)."""

_RUNNERS: dict[tuple, tuple] = {}

current_device = torch.cuda.current_device
"""The device index Triton launches on (its driver's current device is torch's)."""


class _Direct(NamedTuple):
    """A loaded compiled kernel's direct launch: its launcher (``CompiledKernel.run``), the
    three grid dims, its function handle and packed metadata (the launcher's arguments
    before the stream and after it), Triton's current-stream query and
    ``triton.knobs.runtime`` (where the launch hooks are set)."""

    launcher: object
    grid: tuple[int, int, int]
    function: object
    metadata: object
    stream_of: object
    hooks: object

    def __call__(self, device: int, values: list, constants: tuple) -> None:
        self.launcher(*self.grid, self.stream_of(device), self.function, self.metadata,
                      None, None, None, *values, *constants)

    def hooked(self) -> bool:
        """Whether a launch hook is set: a hook chain (Triton 3.6) holding a hook, or any
        other object but None."""
        return _is_set(self.hooks.launch_enter_hook) or _is_set(self.hooks.launch_exit_hook)


def launch_key(kernel, grid: tuple, args: tuple, kwargs: dict) -> tuple:
    """What fixes the compiled kernel ``kernel[grid](*args, **kwargs)`` launches (above)."""
    return _key_and_values(kernel, grid, args, kwargs)[0]


def _key_and_values(kernel, grid: tuple, args: tuple, kwargs: dict
                    ) -> tuple[tuple, list, int]:
    """The :func:`launch_key`, the runtime arguments as the compiled kernel's launcher
    takes them (each tensor as its address: an int, which the launcher passes on as it is;
    a tensor it would ask the driver about; the rest as they are) and the current device,
    which the key holds."""
    device = current_device()
    key = [kernel, grid, device, *kwargs.items()]
    values = []
    for a in args:
        if isinstance(a, torch.Tensor):
            address = a.data_ptr()
            key.append(a.dtype)
            key.append(address & 15 == 0)
            values.append(address)
        else:
            key.append(type(a))
            key.append(None if type(a) is float else a)
            values.append(a)
    return tuple(key), values, device


def launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` on the current CUDA stream, through the compiled
    kernel's launcher where this launch key was seen."""
    key, values, device = _key_and_values(kernel, grid, args, kwargs)
    found = _RUNNERS.get(key)
    if found is not None:
        runner, direct, constants = found
        if direct is None or direct.hooked():
            runner(*values, *constants)       # (on Triton's current stream, as run's)
        else:
            direct(device, values, constants)
        return
    compiled = kernel[grid](*args, **kwargs)
    if len(_RUNNERS) >= MAX_KEYS:
        _RUNNERS.clear()
    grid3 = (*grid, *(1,) * (3 - len(grid)))
    runner = compiled[grid3]                  # (loads the kernel: its handles are set)
    _RUNNERS[key] = (runner, _direct(compiled, grid3), _constants(kernel, len(args), kwargs))


def _direct(compiled, grid3: tuple) -> _Direct | None:
    """The direct launch of a loaded compiled kernel; None for an object that is no
    ``CompiledKernel`` (a test's stand-in) or a Triton without ``triton.knobs`` (before
    3.4: its hooks are not read here)."""
    try:
        launcher, function = compiled.run, compiled.function
        metadata = compiled.packed_metadata
    except AttributeError:
        return None
    hooks = launch_hooks()
    if hooks is None:
        return None
    return _Direct(launcher, grid3, function, metadata, stream_query(), hooks)


def launch_hooks():
    """``triton.knobs.runtime``, where the launch hooks are set; None before Triton 3.4."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime


def stream_query():
    """Triton's driver's query of a device's current stream (device index -> handle)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


def _is_set(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)      # (a HookChain's hooks)
    return calls is None or len(calls) > 0


def _constants(kernel, given: int, kwargs: dict) -> tuple:
    """The values of ``kernel``'s parameters after the first ``given`` (its constexprs), in
    parameter order: from ``kwargs``, else the parameter's default."""
    params = list(inspect.signature(kernel.fn).parameters.values())[given:]
    return tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params)
