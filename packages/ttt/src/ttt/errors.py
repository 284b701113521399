"""The errors of "no backend here for this call": ``BackendError`` and its subclasses, and
:func:`import_failure_reason`, which backends use to say why their engine does not import."""

from __future__ import annotations

from collections.abc import Mapping


class BackendError(Exception):
    """No backend here for this call: the base of every backend error (unknown, not
    installed, cannot run here, cannot take the inputs)."""


class UnknownBackendError(BackendError, ValueError):
    """A backend name that is neither built in, registered, nor an entry point."""


class BackendNotInstalledError(BackendError, ImportError):
    """A known backend whose module cannot be imported; ``reason`` says what to install."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"ttt backend {name!r} is not installed: {reason}")
        self.backend = name
        self.reason = reason


class BackendNotSupportedError(BackendError, ValueError):
    """The chosen backend (or every backend) cannot take these inputs; says why."""


class BackendUnavailableError(BackendNotSupportedError):
    """A backend asked for by name is installed but cannot run on this machine; says why.
    (A :class:`BackendNotSupportedError`, as such a call raised before this class existed.)"""


def import_failure_reason(err: ImportError, hints: Mapping[str, str]) -> str:
    """Why an import failed: the module (``err.name``) and how to install it,
    ``hints[its top-level name]`` or else ``pip install <top-level name>``."""
    if not err.name:
        return f"an import failed ({err})"
    top = err.name.partition(".")[0]
    hint = hints.get(top) or f"pip install {top}"
    return f"module {err.name!r} cannot be imported ({err}); install with: {hint}"
