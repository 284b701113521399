"""The pytest plugin of ttt's conformance suite (registered as the ``pytest11`` entry point
``ttt.testing.plugin``; with plugin autoloading off, load it with ``-p ttt.testing.plugin``).

    pytest --pyargs ttt.testing --ttt-backend NAME [--ttt-device cuda] [-m "not big"]

- ``--ttt-backend NAME``: the backend under test (default ``reference``), by the name it is
  registered under (built in, or the entry-point group ``ttt.backends``). When given, a
  backend that cannot be loaded, or cannot run on the test device, is an error at session
  start, never a suite of skips. ``--ttt-allow-unavailable`` runs the suite anyway (for a
  machine the backend is not meant for: every case then skips with the backend's reason).
- ``--ttt-device``: the device of the test tensors (default: cuda when the backend runs
  there and a GPU is present, else cpu).

Each suite test belongs to one op (``test_mlp``'s to ``"ttt_mlp"``, the others to
``"ttt_linear"``); those of an op the backend does not declare in ``Capabilities.ops`` skip
with that reason. The report header names the backend, its versions and the device; the
terminal summary counts the skipped tests by reason. Fixtures: ``ttt_backend_name``,
``ttt_backend``, ``ttt_device``. Until ``--ttt-backend`` is given or a suite test runs, the
plugin does nothing but register its options and markers.
"""

from __future__ import annotations

import platform
from collections import Counter

import pytest

DEFAULT_BACKEND = "reference"


def pytest_addoption(parser):
    group = parser.getgroup("ttt", "ttt conformance suite (ttt.testing)")
    group.addoption("--ttt-backend", dest="ttt_backend", default=None,
                    help="ttt backend under test (default: reference); one that cannot load "
                         "or run on the test device is an error")
    group.addoption("--ttt-device", dest="ttt_device", default=None,
                    help="device of the test tensors (default: cuda when the backend runs "
                         "there and a GPU is present, else cpu)")
    group.addoption("--ttt-allow-unavailable", dest="ttt_allow_unavailable",
                    action="store_true", default=False,
                    help="run the suite even if the backend cannot run on the test device "
                         "(every case then skips with the backend's reason)")


def pytest_configure(config):
    config.addinivalue_line("markers", "big: slow on CPU (long sequences, whole compile "
                                       "checks); deselect on CPU with -m 'not big'")
    config.addinivalue_line("markers", "whole_device: needs most of the device's memory; run "
                                       "these alone, with no other test process on the "
                                       "device (-m whole_device -n 0)")
    config.addinivalue_line("markers", "xdist_group(name): tests of one oracle case "
                                       "(pytest-xdist --dist loadgroup keeps them together)")
    if config.getoption("ttt_backend") is not None:
        _require_runnable(config)


def _backend_name(config) -> str:
    return config.getoption("ttt_backend") or DEFAULT_BACKEND


def _load(config):
    import ttt

    return ttt.load_backend(_backend_name(config))


def _device_for(config, backend) -> str:
    import torch

    chosen = config.getoption("ttt_device")
    if chosen:
        return chosen
    if "cuda" in backend.capabilities.devices and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _why_not_runnable(config, backend) -> str | None:
    import torch

    why = backend.unavailable_reason()
    device = torch.device(_device_for(config, backend))
    if device.type not in backend.capabilities.devices:
        declared = sorted(backend.capabilities.devices)
        why = (f"{why}; " if why else "") + f"does not run on {device.type} (declares {declared})"
    return why


def _require_runnable(config) -> None:
    """An error at session start: the backend named cannot load, or cannot run here."""
    name = _backend_name(config)
    try:
        backend = _load(config)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the user's error to see
        raise pytest.UsageError(f"ttt backend {name!r} cannot be loaded: "
                                f"{type(exc).__name__}: {exc}") from exc
    why = _why_not_runnable(config, backend)
    if why and not config.getoption("ttt_allow_unavailable"):
        raise pytest.UsageError(
            f"ttt backend {name!r} cannot run here: {why}. Run it where it runs (e.g. "
            f"--ttt-device cuda on a GPU), or pass --ttt-allow-unavailable to run the suite "
            f"with every case that needs the backend skipped for this reason")


OP_OF_MODULE = {"ttt.testing.test_mlp": "ttt_mlp"}
"""The op of each suite module's tests, where not ``"ttt_linear"``."""


def suite_op(item) -> str | None:
    """The op a suite test checks (None: not a suite test)."""
    module = getattr(getattr(item, "function", None), "__module__", None) or ""
    if not module.startswith("ttt.testing.test_"):
        return None
    return OP_OF_MODULE.get(module, "ttt_linear")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Skips a suite test of an op the backend under test does not declare."""
    op = suite_op(item)
    if op is None or item.config.getoption("ttt_backend") is None:
        return
    backend = _load(item.config)
    if op not in backend.capabilities.ops:
        pytest.skip(f"{backend.name} declares: op {op!r} not provided (provides "
                    f"{sorted(backend.capabilities.ops)})")


def pytest_report_header(config):
    if config.getoption("ttt_backend") is None:
        return None
    import torch

    import ttt

    backend = _load(config)
    device = _device_for(config, backend)
    where = device
    if device.startswith("cuda") and torch.cuda.is_available():
        where += f" ({torch.cuda.get_device_name(torch.device(device))})"
    versions = ", ".join(f"{k} {v}" for k, v in backend.versions().items())
    why = _why_not_runnable(config, backend)
    return [f"ttt backend: {backend.name} [{versions}]"
            + (f" UNAVAILABLE HERE (--ttt-allow-unavailable): {why}" if why else ""),
            f"ttt {ttt.__version__}, torch {torch.__version__}, python "
            f"{platform.python_version()}, device: {where}"]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Skipped tests counted by reason, so that a skip is never mistaken for a pass."""
    if config.getoption("ttt_backend") is None:
        return
    skipped = terminalreporter.stats.get("skipped", [])
    passed = len(terminalreporter.stats.get("passed", []))
    terminalreporter.section(f"ttt backend {_backend_name(config)!r}: {passed} passed, "
                             f"{len(skipped)} skipped")
    for reason, count in Counter(_skip_reason(r) for r in skipped).most_common():
        terminalreporter.write_line(f"{count:5d} skipped: {reason}")


@pytest.fixture(scope="session")
def ttt_backend_name(pytestconfig) -> str:
    return _backend_name(pytestconfig)


@pytest.fixture(scope="session")
def ttt_backend(pytestconfig):
    """The backend under test (``ttt.load_backend`` of ``--ttt-backend``)."""
    return _load(pytestconfig)


@pytest.fixture(scope="session")
def ttt_device(pytestconfig, ttt_backend):
    import torch

    return torch.device(_device_for(pytestconfig, ttt_backend))
