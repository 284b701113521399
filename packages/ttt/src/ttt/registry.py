"""Backend registry: a table of known backends, lazily read entry points, a ContextVar.

Two layers, as in fsspec: ``KNOWN_BACKENDS`` names each backend we ship with the object to
load and the exact pip command that installs it; loaded backends are cached in ``_LOADED``.
Third parties register with an entry point in the group ``ttt.backends`` whose value loads
a zero-argument factory (a Backend subclass works); entry points are read only when a name
is not in the table, or when all backends are listed, never at ``import ttt``.

The active choice lives in a ``ContextVar`` (thread- and task-safe). Precedence for a call:
``backend=`` argument > ``set_backend`` in the current context > ``TTT_BACKEND`` > automatic.
"""

from __future__ import annotations

import contextvars
import importlib
import os
import warnings
from dataclasses import dataclass
from importlib import metadata

from .backend import Backend
from .problem import Problem

ENTRY_POINT_GROUP = "ttt.backends"
AUTO = "auto"


@dataclass(frozen=True)
class KnownBackend:
    target: str          # "module:attribute", a zero-argument factory returning a Backend
    install_hint: str    # the exact command that installs it
    priority: int        # automatic choice: lower first


KNOWN_BACKENDS: dict[str, KnownBackend] = {
    "triton": KnownBackend("ttt_triton.backend:TritonBackend",
                           "pip install ./packages/ttt-triton  (from a ttt checkout)", 10),
    "cupy": KnownBackend("ttt_cupy.backend:CupyBackend",
                         "pip install './packages/ttt-cupy[cuda13]'  (from a ttt checkout; "
                         "[cuda12] for CUDA 12)", 20),
    "reference": KnownBackend("ttt.reference:ReferenceBackend",
                              "pip install ./packages/ttt  (it ships with ttt)", 1000),
}
_ENTRY_POINT_PRIORITY = 500

_LOADED: dict[str, Backend] = {}
_FAILED: dict[str, str] = {}
_ENTRY_POINTS: dict[str, metadata.EntryPoint] | None = None
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ttt_backend", default=None)


class BackendNotSupportedError(ValueError):
    """The chosen backend (or every backend) cannot take these inputs; says why."""


def _entry_points() -> dict[str, metadata.EntryPoint]:
    global _ENTRY_POINTS
    if _ENTRY_POINTS is None:
        found: dict[str, metadata.EntryPoint] = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in KNOWN_BACKENDS:
                known = KNOWN_BACKENDS[ep.name].target
                if ep.value.replace(" ", "") != known:
                    warnings.warn(f"ttt: entry point {ep.name!r} -> {ep.value!r} ignored: "
                                  f"{ep.name!r} is a built-in backend name ({known})",
                                  stacklevel=3)
                continue
            if ep.name in found and found[ep.name].value != ep.value:
                raise RuntimeError(f"ttt: two entry points claim backend {ep.name!r}: "
                                   f"{found[ep.name].value!r} and {ep.value!r}")
            found[ep.name] = ep
        _ENTRY_POINTS = found
    return _ENTRY_POINTS


def known_names() -> list[str]:
    """Every backend name ttt knows of: the built-in table, then entry points."""
    return list(KNOWN_BACKENDS) + [n for n in _entry_points() if n not in KNOWN_BACKENDS]


def _priority(name: str) -> int:
    known = KNOWN_BACKENDS.get(name)
    return known.priority if known else _ENTRY_POINT_PRIORITY


def _install_hint(name: str) -> str:
    known = KNOWN_BACKENDS.get(name)
    return known.install_hint if known else f"reinstall the package that provides {name!r}"


def load_backend(name: str) -> Backend:
    """The backend object for ``name``; ImportError with the pip command if not installed."""
    if name in _LOADED:
        return _LOADED[name]
    if name not in KNOWN_BACKENDS and name not in _entry_points():
        raise ValueError(f"backend: unknown backend {name!r}; known: {known_names()} "
                         f"(third-party backends register in the entry-point group "
                         f"{ENTRY_POINT_GROUP!r})")
    try:
        if name in KNOWN_BACKENDS:
            module_name, _, attribute = KNOWN_BACKENDS[name].target.partition(":")
            factory = getattr(importlib.import_module(module_name), attribute)
        else:
            factory = _entry_points()[name].load()
    except ImportError as exc:
        _FAILED[name] = f"not installed ({exc}); install with: {_install_hint(name)}"
        raise ImportError(f"ttt backend {name!r} is not installed ({exc}). "
                          f"Install it with: {_install_hint(name)}") from exc
    backend = factory() if callable(factory) and not isinstance(factory, Backend) else factory
    if not isinstance(backend, Backend):
        raise TypeError(f"backend {name!r}: its factory returned {type(backend).__name__}, "
                        f"expected a ttt.Backend")
    _LOADED[name] = backend
    return backend


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str | None
    versions: dict[str, str]


def available_backends() -> dict[str, BackendStatus]:
    """For each known and discovered backend: does it load here, and if not, why."""
    report = {}
    for name in known_names():
        try:
            backend = load_backend(name)
        except Exception as exc:  # noqa: BLE001 - a report, not a dispatch
            report[name] = BackendStatus(name, False, str(exc), {})
            continue
        reason = backend.unavailable_reason()
        report[name] = BackendStatus(name, reason is None, reason, backend.versions())
    return report


class _BackendChoice:
    """Returned by :func:`set_backend`; a context manager restoring the previous choice."""

    def __init__(self, token: contextvars.Token, name: str):
        self._token = token
        self.name = name

    def __enter__(self) -> _BackendChoice:
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._token)

    def __repr__(self) -> str:
        return f"<ttt backend choice {self.name!r}>"


def set_backend(name: str | None) -> _BackendChoice:
    """Choose the backend for the current context (``None`` or ``"auto"``: automatic).

    Works as a plain call and as ``with ttt.set_backend("triton"): ...``, which restores
    the previous choice on exit. Raises ImportError with the pip command if not installed.
    """
    if name is None:
        name = AUTO
    if not isinstance(name, str):
        raise TypeError(f"set_backend: expected a backend name (str) or None, "
                        f"got {type(name).__name__}")
    if name != AUTO:
        load_backend(name)
    return _BackendChoice(_CURRENT.set(name), name)


def get_backend() -> str:
    """The active choice: a backend name, or ``"auto"`` (best backend for the inputs)."""
    name = _CURRENT.get()
    if name is None:
        name = os.environ.get("TTT_BACKEND") or AUTO
    return name


def _reasons_text(reasons: dict[str, list[str]]) -> str:
    return "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items())


_WARNED: set[tuple[str, ...]] = set()


def select_backend(problem: Problem, requested: str | None = None) -> Backend:
    """The backend for one call: the requested or active one, else the best that fits."""
    name = requested if requested is not None else get_backend()
    if name != AUTO:
        backend = load_backend(name)
        reasons = backend.not_supported_reasons(problem)
        if reasons:
            raise BackendNotSupportedError(
                f"backend {name!r} cannot take these inputs ({problem.describe()}): "
                f"{'; '.join(reasons)}")
        return backend

    skipped: dict[str, list[str]] = {}
    for candidate in sorted(known_names(), key=_priority):
        try:
            backend = load_backend(candidate)
        except ImportError:
            skipped[candidate] = [f"not installed ({_install_hint(candidate)})"]
            continue
        reasons = backend.not_supported_reasons(problem)
        if not reasons:
            installed_but_unfit = {n: r for n, r in skipped.items() if n in _LOADED}
            if installed_but_unfit and problem.device.type != "cpu":
                key = tuple(sorted(_reasons_text(installed_but_unfit)))
                if key not in _WARNED:
                    _WARNED.add(key)
                    warnings.warn(f"ttt: using backend {candidate!r}; skipped "
                                  f"{_reasons_text(installed_but_unfit)}", stacklevel=4)
            return backend
        skipped[candidate] = reasons
    raise BackendNotSupportedError(
        f"no ttt backend can take these inputs ({problem.describe()}): {_reasons_text(skipped)}")
