"""Backend registry: the backends ttt knows of (registered in this process, built in, then
entry points of group ``ttt.backends``, read on first need) and how each is loaded, once.
What the choice (:mod:`ttt.choice`) keeps lives here too (docs/api.md, "Backends")."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType

from .backend import Backend, Capabilities
from .errors import (  # noqa: F401 - also ttt.registry's names, as the backends import them
    BackendError,
    BackendNotInstalledError,
    BackendNotSupportedError,
    BackendUnavailableError,
    UnknownBackendError,
    import_failure_reason,
)

ENTRY_POINT_GROUP = "ttt.backends"
AUTO = "auto"                  # the automatic choice's name (no backend may take it)
PLUGIN_PRIORITY = 500         # entry points' and registrations' place: after triton, cupy


@dataclass(frozen=True)
class KnownBackend:
    """How to load one backend, and where the automatic choice tries it."""

    target: object       # "module:attribute" naming a factory, or the factory or Backend itself
    install_hint: str    # the exact command that installs it
    priority: int        # automatic choice: lower first


KNOWN_BACKENDS: Mapping[str, KnownBackend] = MappingProxyType({
    "triton": KnownBackend("ttt_triton.backend:TritonBackend",
                           "pip install ./packages/ttt-triton  (from a ttt checkout)", 10),
    "cupy": KnownBackend("ttt_cupy.backend:CupyBackend",
                         "pip install './packages/ttt-cupy[cuda13]'  (from a ttt checkout; "
                         "[cuda12] for CUDA 12)", 20),
    "reference": KnownBackend("ttt.reference:ReferenceBackend",
                              "pip install ./packages/ttt  (it ships with ttt)", 1000),
})
"""The built-in backends, read-only (others: :func:`register_backend`, entry points)."""


@dataclass
class _State:
    registered: dict[str, KnownBackend] = field(default_factory=dict)
    entry_points: dict[str, KnownBackend] | None = None     # None: not read yet
    loaded: dict[str, Backend] = field(default_factory=dict)
    kept: dict[tuple, Backend] = field(default_factory=dict)   # the choices (ttt.choice)
    not_installed: dict[str, str] = field(default_factory=dict)   # name -> reason
    warned: set[tuple[str, str]] = field(default_factory=set)     # (chosen, passed over)


_state = _State()


def _forget_choices() -> None:
    """Drops the choices kept, the backends found not installed, the warnings given."""
    _state.kept.clear()
    _state.not_installed.clear()
    _state.warned.clear()


def clear_cache() -> None:
    """Forgets what the choice keeps, the entry points and the backends loaded from them:
    call it after installing or removing a backend package in a running process."""
    for name in set(_state.entry_points or ()) - set(_state.registered):
        _state.loaded.pop(name, None)
    _state.entry_points = None
    importlib.invalidate_caches()
    _forget_choices()


def _read_entry_points() -> dict[str, KnownBackend]:
    """The group's entry points by name; one with a built-in name is passed over (with a
    warning unless it names the built-in's own target)."""
    found: dict[str, KnownBackend] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in KNOWN_BACKENDS:
            known = KNOWN_BACKENDS[ep.name].target
            if ep.value.replace(" ", "") != known:
                warnings.warn(f"ttt: entry point {ep.name!r} -> {ep.value!r} ignored: "
                              f"{ep.name!r} is a built-in backend name ({known})",
                              stacklevel=4)
            continue
        target = f"{ep.module}:{ep.attr or ''}"
        if ep.name in found and found[ep.name].target != target:
            raise RuntimeError(f"ttt: two entry points claim backend {ep.name!r}: "
                               f"{found[ep.name].target!r} and {ep.value!r}")
        found[ep.name] = KnownBackend(
            target, f"reinstall the package that provides {ep.name!r}", PLUGIN_PRIORITY)
    return found


def _entry_points() -> dict[str, KnownBackend]:
    if _state.entry_points is None:
        _state.entry_points = _read_entry_points()
        _forget_choices()                   # (entry points read again: maybe others)
    return _state.entry_points


def known_names() -> list[str]:
    """Every backend name ttt knows of: built in, registered, then entry points."""
    return list(dict.fromkeys([*KNOWN_BACKENDS, *_state.registered, *_entry_points()]))


def _known(name: str) -> KnownBackend:
    """How to load backend ``name`` (registered, built in, else an entry point)."""
    known = (_state.registered.get(name) or KNOWN_BACKENDS.get(name)
             or _entry_points().get(name))
    if known is None:
        raise UnknownBackendError(
            f"backend: unknown backend {name!r}; known: {known_names()} (others register "
            f"with ttt.register_backend or in the entry-point group {ENTRY_POINT_GROUP!r})")
    return known


def _factory(name: str):
    """What backend ``name``'s target names (a factory or a Backend), imported."""
    known = _known(name)
    if not isinstance(known.target, str):
        return known.target
    module_name, _, attribute = known.target.replace(" ", "").partition(":")
    try:
        found = importlib.import_module(module_name)
    except ImportError as exc:
        own_package = module_name.partition(".")[0]
        reason = import_failure_reason(exc, {own_package: known.install_hint})
        raise BackendNotInstalledError(name, reason) from exc
    for part in filter(None, attribute.split(".")):
        found = getattr(found, part)
    return found


def load_backend(name: str) -> Backend:
    """The backend object for ``name``. Raises :class:`UnknownBackendError` (a ValueError)
    for an unknown name, :class:`BackendNotInstalledError` (an ImportError naming the
    missing module and the pip command) for one not installed."""
    backend = _state.loaded.get(name)
    if backend is None:
        factory = _factory(name)
        backend = factory if isinstance(factory, Backend) or not callable(factory) else factory()
        if not isinstance(backend, Backend):
            raise TypeError(f"backend {name!r}: its factory returned "
                            f"{type(backend).__name__}, expected a ttt.Backend")
        _state.loaded[name] = backend
    return backend


@dataclass(frozen=True, repr=False, eq=False)
class Undo:
    """What :func:`register_backend` and ``set_backend`` return: a context manager that
    undoes the call on exit."""

    what: str
    name: str
    undo: Callable[[], None]

    def __enter__(self) -> Undo:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"<ttt backend {self.what} {self.name!r}>"


def _set_registration(name: str, known: KnownBackend | None) -> None:
    """Registers ``known`` as ``name`` (None: unregisters); drops its loaded backend and the
    choices."""
    if known is None:
        _state.registered.pop(name, None)
    else:
        _state.registered[name] = known
    _state.loaded.pop(name, None)
    _forget_choices()


def _check_registration(name, backend, priority, install_hint) -> None:
    if not isinstance(name, str) or name in ("", AUTO):
        raise ValueError(f"register_backend: name must be a non-empty str other than "
                         f"{AUTO!r}, got {name!r}")
    if not (isinstance(backend, (Backend, str)) or callable(backend)):
        raise TypeError(f"register_backend: backend must be a ttt.Backend, a zero-argument "
                        f"factory or a 'module:attribute' str, got {type(backend).__name__}")
    if isinstance(backend, str) and ":" not in backend:
        raise ValueError(f"register_backend: backend must name 'module:attribute', got "
                         f"{backend!r}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"register_backend: priority must be an int, got {priority!r}")
    if not isinstance(install_hint, (str, type(None))):
        raise TypeError(f"register_backend: install_hint must be a str or None, got "
                        f"{install_hint!r}")


def register_backend(name: str, backend, *, priority: int = PLUGIN_PRIORITY,
                     install_hint: str | None = None, replace: bool = False) -> Undo:
    """Registers ``backend`` under ``name`` in this process: a :class:`~ttt.Backend`, a
    zero-argument factory or a ``"module:attribute"`` str naming one, imported on first use
    (``install_hint``: shown when that import fails); ``priority``: its place in the
    automatic choice (lower first). Returns a context manager that undoes it (docs/api.md,
    "Backends")."""
    _check_registration(name, backend, priority, install_hint)
    hint = install_hint or f"reinstall the package that provides {name!r}"
    known = KnownBackend(backend, hint, priority)
    previous = _state.registered.get(name)
    taken = previous or KNOWN_BACKENDS.get(name) or _entry_points().get(name)
    if taken is not None and taken != known and not replace:
        raise ValueError(f"register_backend: backend {name!r} exists already ({taken.target!r});"
                         f" pass replace=True to replace it")
    _set_registration(name, known)

    def undo() -> None:         # (the registration it replaced comes back)
        if _state.registered.get(name) is known:
            _set_registration(name, previous)

    return Undo("registration", name, undo)


def unregister_backend(name: str) -> None:
    """Removes ``name``'s :func:`register_backend` registration (a backend it replaced comes
    back); ValueError for a name not registered so."""
    if name not in _state.registered:
        raise ValueError(f"unregister_backend: {name!r} was not registered with "
                         f"register_backend (registered: {sorted(_state.registered)})")
    _set_registration(name, None)


def declared_capabilities(name: str) -> Capabilities:
    """The capabilities of backend ``name``'s class, read without importing its engine (an
    instance may widen them: Triton's adds cpu under its interpreter); a backend whose class
    declares none is loaded and asked."""
    capabilities = getattr(_factory(name), "capabilities", None)
    if isinstance(capabilities, Capabilities):
        return capabilities
    return load_backend(name).capabilities
