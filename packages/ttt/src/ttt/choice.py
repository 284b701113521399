"""Which backend a call runs on: the precedence and what is kept, docs/api.md "Backends".
What is kept lives in the registry's state, per name asked for and problem signature."""

from __future__ import annotations

import contextvars
import os
import warnings

import torch

from .backend import Backend
from .errors import (
    BackendNotInstalledError,
    BackendNotSupportedError,
    BackendUnavailableError,
    UnknownBackendError,
)
from .problem import Problem
from .registry import AUTO, Undo, _forget_choices, _known, _state, known_names, load_backend

MAX_KEPT_CHOICES = 1024     # (packed batches of new lengths are new signatures)

_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ttt_backend", default=None)


def set_backend(name: str | None) -> Undo:
    """Choose the backend for the current context (``None`` or ``"auto"``: automatic); as
    ``with ttt.set_backend("triton"): ...`` restores the previous choice on exit. Raises
    ImportError with the pip command if not installed."""
    if name is None:
        name = AUTO
    if not isinstance(name, str):
        raise TypeError(f"set_backend: expected a backend name (str) or None, "
                        f"got {type(name).__name__}")
    if name != AUTO:
        load_backend(name)
    _forget_choices()
    token = _CURRENT.set(name)
    return Undo("choice", name, lambda: _CURRENT.reset(token))


def get_backend() -> str:
    """The active choice: a backend name, or ``"auto"`` (best backend for the inputs)."""
    return _CURRENT.get() or os.environ.get("TTT_BACKEND") or AUTO     # (set: never "")


def select_backend(problem: Problem, requested: str | None = None) -> Backend:
    """The backend for one call: the requested or active one, else the best that fits."""
    name = requested if requested is not None else get_backend()
    key = (name, _choice_key(problem))
    backend = _state.kept.get(key)
    if backend is None:
        backend = (_automatic_choice(problem) if name == AUTO
                   else _named_choice(name, problem, requested))
        if len(_state.kept) >= MAX_KEPT_CHOICES:
            _state.kept.clear()
        _state.kept[key] = backend
    return backend


def _choice_key(problem: Problem) -> tuple:
    """Everything of ``problem`` but its tensors' values: the choices are kept by it."""
    return (problem.q.shape, problem.scale, problem.eps, problem.signature())


def _named_choice(name: str, problem: Problem, requested: str | None) -> Backend:
    """Backend ``name`` where it takes ``problem``; else the error that says why."""
    try:
        backend = load_backend(name)
    except UnknownBackendError as exc:
        if requested is None and _CURRENT.get() is None:       # the name came from the env
            raise UnknownBackendError(
                f"TTT_BACKEND: {str(exc).removeprefix('backend: ')}") from None
        raise
    reasons = backend.not_supported_reasons(problem)
    if reasons:
        error = (BackendUnavailableError if backend.unavailable_reason() is not None
                 else BackendNotSupportedError)
        raise error(f"backend {name!r} cannot take these inputs ({problem.describe()}): "
                    f"{'; '.join(reasons)}")
    return backend


def _reasons_text(reasons: dict[str, list[str]]) -> str:
    return "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items())


def _automatic_choice(problem: Problem) -> Backend:
    """The first backend by priority that takes ``problem``, else every backend's reasons."""
    skipped: dict[str, list[str]] = {}
    for candidate in sorted(known_names(), key=lambda name: _known(name).priority):
        try:
            reason = _state.not_installed.get(candidate)
            if reason is not None:             # found not installed before: no import again
                raise BackendNotInstalledError(candidate, reason)
            backend = load_backend(candidate)
        except ImportError as exc:
            if isinstance(exc, BackendNotInstalledError):
                _state.not_installed[candidate] = exc.reason
            skipped[candidate] = [f"not installed: {getattr(exc, 'reason', exc)}"]
            continue
        reasons = backend.not_supported_reasons(problem)
        if not reasons:
            _warn_once_of_passed_over(candidate, skipped, problem.device)
            return backend
        skipped[candidate] = reasons
    raise BackendNotSupportedError(
        f"no ttt backend can take these inputs ({problem.describe()}): {_reasons_text(skipped)}")


def _warn_once_of_passed_over(chosen: str, skipped: dict[str, list[str]],
                              device: torch.device) -> None:
    """Warns, once per choice and reasons, of installed backends passed over for ``chosen``
    off the CPU (and meta)."""
    passed_over = {n: r for n, r in skipped.items() if n in _state.loaded}
    if not passed_over or device.type in ("cpu", "meta"):
        return
    key = (chosen, _reasons_text(passed_over))
    if key not in _state.warned:
        _state.warned.add(key)
        warnings.warn(f"ttt: using backend {chosen!r}; skipped {key[1]}", stacklevel=6)
