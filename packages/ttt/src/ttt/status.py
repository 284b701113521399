"""Whether each backend runs here, and if not, why: :func:`available_backends` (what
``python -m ttt info`` lists) and :func:`backend_status`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import Backend
from .errors import BackendNotInstalledError, UnknownBackendError
from .registry import known_names, load_backend


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend runs here (it loads, its engine imports, a device it declares is
    present); else ``reason``: "not installed...", "unavailable..." or "installed, needs..."."""

    name: str
    available: bool
    reason: str | None
    versions: dict[str, str]
    installed: bool = True


DEVICE_WORDS = {"cuda": "a CUDA GPU", "mps": "an Apple GPU (mps)", "xpu": "an Intel GPU (xpu)"}


def present_device_types() -> frozenset[str]:
    """The device types this machine can run tensors on (no CUDA context is created)."""
    present = {"cpu", "meta"}
    for name, module in (("cuda", torch.cuda), ("mps", torch.backends.mps),
                         ("xpu", getattr(torch, "xpu", None))):
        if module is not None and module.is_available():
            present.add(name)
    return frozenset(present)


def missing_device_reason(backend: Backend) -> str | None:
    """Why ``backend`` cannot run on this machine's devices, or None."""
    devices = backend.capabilities.devices
    if devices & present_device_types():
        return None
    wanted = " or ".join(DEVICE_WORDS.get(d, f"a {d} device") for d in sorted(devices))
    return f"installed, needs {wanted}"


def backend_status(name: str) -> BackendStatus:
    """Whether backend ``name`` runs here, and if not, why; UnknownBackendError if unknown."""
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
