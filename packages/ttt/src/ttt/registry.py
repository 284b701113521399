"""Backend registry: a table of known backends, lazily read entry points, a ContextVar.

Two layers, as in fsspec: ``KNOWN_BACKENDS`` names each backend we ship with the object to
load and the exact pip command that installs it; loaded backends are cached in ``_LOADED``.
Third parties register with an entry point in the group ``ttt.backends`` whose value loads
a zero-argument factory (a Backend subclass works); entry points are read only when a name
is not in the table, or when all backends are listed, never at ``import ttt``.

The active choice lives in a ``ContextVar`` (thread- and task-safe). Precedence for a call:
``backend=`` argument > ``set_backend`` in the current context > ``TTT_BACKEND`` > automatic.

Two caches serve the choice: the backend chosen per name asked for (or the automatic
choice) and problem signature, a named backend only where it takes the problem (one that
refuses it is asked again, and raises, every time); and which backends failed to import
(the automatic choice passes over them without importing them again). Both are dropped
by :func:`set_backend`, by any change of ``KNOWN_BACKENDS`` or of the loaded backends
(registration), when the entry points are read again, and by :func:`clear_cache`, which
also reads the entry points again: after installing a backend package in a running
process, call ``ttt.registry.clear_cache()``. Nothing expires by time.
"""

from __future__ import annotations

import contextvars
import importlib
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

import torch

from .backend import Backend, Capabilities
from .problem import Problem

ENTRY_POINT_GROUP = "ttt.backends"
AUTO = "auto"


@dataclass(frozen=True)
class KnownBackend:
    target: str          # "module:attribute", a zero-argument factory returning a Backend
    install_hint: str    # the exact command that installs it
    priority: int        # automatic choice: lower first


class _Table(dict):
    """A dict whose every change drops the automatic choice's caches (see
    :func:`_forget_choices`): the backends known (``KNOWN_BACKENDS``) and loaded, which a
    caller may change in place (``monkeypatch.setitem``, a test's own backend)."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _forget_choices()

    def __delitem__(self, key):
        super().__delitem__(key)
        _forget_choices()

    def pop(self, *args):
        try:
            return super().pop(*args)
        finally:
            _forget_choices()

    def popitem(self):
        try:
            return super().popitem()
        finally:
            _forget_choices()

    def setdefault(self, key, default=None):
        try:
            return super().setdefault(key, default)
        finally:
            _forget_choices()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        _forget_choices()

    def clear(self):
        super().clear()
        _forget_choices()

    def __ior__(self, other):
        self.update(other)
        return self


KNOWN_BACKENDS: dict[str, KnownBackend] = _Table({
    "triton": KnownBackend("ttt_triton.backend:TritonBackend",
                           "pip install ./packages/ttt-triton  (from a ttt checkout)", 10),
    "cupy": KnownBackend("ttt_cupy.backend:CupyBackend",
                         "pip install './packages/ttt-cupy[cuda13]'  (from a ttt checkout; "
                         "[cuda12] for CUDA 12)", 20),
    "reference": KnownBackend("ttt.reference:ReferenceBackend",
                              "pip install ./packages/ttt  (it ships with ttt)", 1000),
})
_ENTRY_POINT_PRIORITY = 500

_LOADED: dict[str, Backend] = _Table()
"""The backends loaded, by name (``load_backend`` adds to it without dropping the caches:
a backend it loads is the one the automatic choice would load)."""
_ENTRY_POINTS: dict[str, metadata.EntryPoint] | None = None
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ttt_backend", default=None)


class BackendError(Exception):
    """No backend here for this call: the base of every backend error, so one
    ``except ttt.BackendError`` catches an unknown name, a backend that is not installed,
    one that cannot run on this machine and one that cannot take the inputs."""


class UnknownBackendError(BackendError, ValueError):
    """A backend name that is neither built in nor registered by an entry point."""


class BackendNotInstalledError(BackendError, ImportError):
    """A known backend whose module cannot be imported; ``reason`` names the missing module
    and how to install it."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"ttt backend {name!r} is not installed: {reason}")
        self.backend = name
        self.reason = reason


class BackendNotSupportedError(BackendError, ValueError):
    """The chosen backend (or every backend) cannot take these inputs; says why."""


class BackendUnavailableError(BackendNotSupportedError):
    """A backend asked for by name is installed but cannot run on this machine (its engine
    or a device it needs is missing); says why. A :class:`BackendNotSupportedError`, as
    such a call raised before this class existed."""


def import_failure_reason(err: ImportError, hints: Mapping[str, str]) -> str:
    """Why an import failed: the module that could not be imported (``err.name``: the
    package asked for, or one of its dependencies) and how to install it,
    ``hints[its top-level name]`` or else ``pip install <top-level name>``."""
    if not err.name:
        return f"an import failed ({err})"
    top = err.name.partition(".")[0]
    hint = hints.get(top) or f"pip install {top}"
    return f"module {err.name!r} cannot be imported ({err}); install with: {hint}"


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
        _forget_choices()                   # (entry points read again: maybe others)
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


def _factory(name: str):
    """What backend ``name``'s target names (a Backend subclass, a zero-argument factory or
    an instance), imported; the errors of :func:`load_backend`."""
    if name not in KNOWN_BACKENDS and name not in _entry_points():
        raise UnknownBackendError(
            f"backend: unknown backend {name!r}; known: {known_names()} (third-party "
            f"backends register in the entry-point group {ENTRY_POINT_GROUP!r})")
    target = (KNOWN_BACKENDS[name].target if name in KNOWN_BACKENDS
              else _entry_points()[name].value)
    module_name, _, attribute = target.replace(" ", "").partition(":")
    try:
        if name in KNOWN_BACKENDS:
            return getattr(importlib.import_module(module_name), attribute)
        return _entry_points()[name].load()
    except ImportError as exc:
        own_package = module_name.partition(".")[0]
        reason = import_failure_reason(exc, {own_package: _install_hint(name)})
        raise BackendNotInstalledError(name, reason) from exc


def load_backend(name: str) -> Backend:
    """The backend object for ``name``. Raises :class:`UnknownBackendError` (a ValueError)
    for a name ttt does not know and :class:`BackendNotInstalledError` (an ImportError,
    naming the missing module and the pip command) for one that is not installed."""
    if name in _LOADED:
        return _LOADED[name]
    factory = _factory(name)
    backend = factory() if callable(factory) and not isinstance(factory, Backend) else factory
    if not isinstance(backend, Backend):
        raise TypeError(f"backend {name!r}: its factory returned {type(backend).__name__}, "
                        f"expected a ttt.Backend")
    dict.__setitem__(_LOADED, name, backend)
    return backend


def declared_capabilities(name: str) -> Capabilities:
    """The capabilities backend ``name`` declares for the machine it is made for: those of
    its class, read without importing its engine (triton, cupy). A loaded instance may
    widen them for the machine it runs on (the Triton backend adds cpu under Triton's
    interpreter); a backend whose class declares none is loaded and asked."""
    capabilities = getattr(_factory(name), "capabilities", None)
    if isinstance(capabilities, Capabilities):
        return capabilities
    return load_backend(name).capabilities


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend runs here. ``available``: it loads, its engine imports and a device
    it declares is present. ``reason`` (None when available) says why not, starting with
    "not installed", "unavailable" or "installed, needs"."""

    name: str
    available: bool
    reason: str | None
    versions: dict[str, str]
    installed: bool = True


DEVICE_WORDS = {"cuda": "a CUDA GPU", "mps": "an Apple GPU (mps)", "xpu": "an Intel GPU (xpu)"}


def present_device_types() -> frozenset[str]:
    """The device types this machine can run tensors on (no CUDA context is created)."""
    present = {"cpu", "meta"}
    if torch.cuda.is_available():
        present.add("cuda")
    if torch.backends.mps.is_available():
        present.add("mps")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        present.add("xpu")
    return frozenset(present)


def missing_device_reason(backend: Backend) -> str | None:
    """Why ``backend`` cannot run on this machine's devices (e.g. "installed, needs a CUDA
    GPU"), or None when a device type it declares is present."""
    devices = backend.capabilities.devices
    if devices & present_device_types():
        return None
    wanted = " or ".join(DEVICE_WORDS.get(d, f"a {d} device") for d in sorted(devices))
    return f"installed, needs {wanted}"


def backend_status(name: str) -> BackendStatus:
    """Whether backend ``name`` runs here, and if not, why (see :class:`BackendStatus`);
    :class:`UnknownBackendError` for a name ttt does not know."""
    try:
        backend = load_backend(name)
    except UnknownBackendError:
        raise
    except BackendNotInstalledError as exc:
        return BackendStatus(name, False, f"not installed: {exc.reason}", {}, installed=False)
    except Exception as exc:  # noqa: BLE001 - a report, not a dispatch
        return BackendStatus(name, False, f"unavailable: failed to load ({exc})", {})
    reason = backend.unavailable_reason()
    if reason is not None:
        return BackendStatus(name, False, f"unavailable: {reason}", backend.versions())
    reason = missing_device_reason(backend)
    return BackendStatus(name, reason is None, reason, backend.versions())


def available_backends() -> dict[str, BackendStatus]:
    """For each known and discovered backend: does it run here, and if not, why."""
    return {name: backend_status(name) for name in known_names()}


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
    _forget_choices()
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

_NOT_INSTALLED: dict[str, str] = {}
"""Backends the automatic choice found not installed, with the reason: it passes over them
without importing them again (a failed import costs tens of microseconds, on every call)
until the caches are dropped (see the module's doc)."""

_KEPT: dict[tuple, Backend] = {}
"""The backend chosen per name asked for (``AUTO`` for the automatic choice) and problem
(``_choice_key``), until the caches are dropped: a named backend kept where it takes the
problem only."""

MAX_KEPT_CHOICES = 1024
"""The choices kept at most (packed batches of new lengths are new signatures)."""


def _forget_choices() -> None:
    """Drops the choices kept and the memo of backends not installed."""
    _KEPT.clear()
    _NOT_INSTALLED.clear()


def clear_cache() -> None:
    """Forgets what the choice keeps (the backend per name and problem signature, the
    backends the automatic choice found not installed) and the entry points read: the next
    call imports and asks the backends again. Call it after installing (or removing) a
    backend package in a running process; ``set_backend`` and changes of the registered or
    loaded backends drop the choices too. Thread-safe as the choice is: a call running
    meanwhile may keep its choice once more."""
    global _ENTRY_POINTS
    _ENTRY_POINTS = None
    importlib.invalidate_caches()
    _forget_choices()


def _load_for_automatic_choice(name: str) -> Backend:
    """:func:`load_backend`, where a backend found not installed since the caches were last
    dropped raises its BackendNotInstalledError again at once."""
    reason = _NOT_INSTALLED.get(name)
    if reason is not None:
        raise BackendNotInstalledError(name, reason)
    try:
        return load_backend(name)
    except BackendNotInstalledError as exc:
        _NOT_INSTALLED[name] = exc.reason
        raise


def select_backend(problem: Problem, requested: str | None = None) -> Backend:
    """The backend for one call: the requested or active one, else the best that fits
    (the automatic choice); kept per name and problem signature until the caches are
    dropped (see the module's doc), a named backend where it takes the problem only."""
    name = requested if requested is not None else get_backend()
    key = (name, _choice_key(problem))
    backend = _KEPT.get(key)
    if backend is None:
        backend = (_automatic_choice(problem) if name == AUTO
                   else _named_choice(name, problem, requested))
        _keep_choice(key, backend)
    return backend


def _named_choice(name: str, problem: Problem, requested: str | None) -> Backend:
    """Backend ``name`` (``requested``, else the active choice) where it takes ``problem``;
    else the error that says why."""
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


def _choice_key(problem: Problem) -> tuple:
    """Everything of ``problem`` but its tensors' values (``problem.signature()`` and the
    batch size, length, scale and eps): the choices are kept by it."""
    return (problem.q.shape, problem.scale, problem.eps, problem.signature())


def _keep_choice(key: tuple, backend: Backend) -> None:
    """Keeps ``backend`` as the choice for ``key`` (a name and a problem's ``_choice_key``;
    all forgotten once MAX_KEPT_CHOICES are kept)."""
    if len(_KEPT) >= MAX_KEPT_CHOICES:
        _KEPT.clear()
    _KEPT[key] = backend


def _automatic_choice(problem: Problem) -> Backend:
    """The first backend by priority that takes ``problem``; warns once where installed
    backends were passed over on a device other than the CPU (or meta: nothing runs)."""
    skipped: dict[str, list[str]] = {}
    for candidate in sorted(known_names(), key=_priority):
        try:
            backend = _load_for_automatic_choice(candidate)
        except ImportError as exc:
            skipped[candidate] = [f"not installed: {getattr(exc, 'reason', exc)}"]
            continue
        reasons = backend.not_supported_reasons(problem)
        if not reasons:
            installed_but_unfit = {n: r for n, r in skipped.items() if n in _LOADED}
            if installed_but_unfit and problem.device.type not in ("cpu", "meta"):
                key = tuple(sorted(_reasons_text(installed_but_unfit)))
                if key not in _WARNED:
                    _WARNED.add(key)
                    warnings.warn(f"ttt: using backend {candidate!r}; skipped "
                                  f"{_reasons_text(installed_but_unfit)}", stacklevel=5)
            return backend
        skipped[candidate] = reasons
    raise BackendNotSupportedError(
        f"no ttt backend can take these inputs ({problem.describe()}): {_reasons_text(skipped)}")
