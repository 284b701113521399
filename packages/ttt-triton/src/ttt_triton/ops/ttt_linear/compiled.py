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
In Triton's interpreter every launch goes through ``JITFunction.run``.
"""

from __future__ import annotations

import inspect

import torch

MAX_KEYS = 1024
"""Launch keys kept; past this many they are all forgotten (the next launches take
``JITFunction.run`` once more)."""

_RUNNERS: dict[tuple, tuple] = {}

current_device = torch.cuda.current_device
"""The device index Triton launches on (its driver's current device is torch's)."""


def launch_key(kernel, grid: tuple, args: tuple, kwargs: dict) -> tuple:
    """What fixes the compiled kernel ``kernel[grid](*args, **kwargs)`` launches (above)."""
    return _key_and_values(kernel, grid, args, kwargs)[0]


def _key_and_values(kernel, grid: tuple, args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """The :func:`launch_key` and the runtime arguments as the compiled kernel's launcher
    takes them: each tensor as its address (an int, which the launcher passes on as it is;
    a tensor it would ask the driver about), the rest as they are."""
    key = [kernel, grid, current_device(), *kwargs.items()]
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
    return tuple(key), values


def launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` on the current CUDA stream, through the compiled
    kernel's launcher where this launch key was seen."""
    key, values = _key_and_values(kernel, grid, args, kwargs)
    found = _RUNNERS.get(key)
    if found is not None:
        runner, constants = found
        runner(*values, *constants)           # (on Triton's current stream, as run's)
        return
    compiled = kernel[grid](*args, **kwargs)
    if len(_RUNNERS) >= MAX_KEYS:
        _RUNNERS.clear()
    grid3 = (*grid, *(1,) * (3 - len(grid)))
    _RUNNERS[key] = (compiled[grid3], _constants(kernel, len(args), kwargs))


def _constants(kernel, given: int, kwargs: dict) -> tuple:
    """The values of ``kernel``'s parameters after the first ``given`` (its constexprs), in
    parameter order: from ``kwargs``, else the parameter's default."""
    params = list(inspect.signature(kernel.fn).parameters.values())[given:]
    return tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params)
