"""This repository's driver of the shipped conformance suite (``ttt.testing``).

    pytest shared_tests --backend triton [--device cuda] [-m "not big"]

``--backend`` and ``--device`` are this checkout's names for the suite plugin's
``--ttt-backend`` and ``--ttt-device`` (default backend: reference); everything else,
fixtures, header and skip summary included, is ``ttt.testing.plugin``.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--backend", dest="ttt_driver_backend", default="reference",
                     help="ttt backend to test (default: reference): --ttt-backend")
    parser.addoption("--device", dest="ttt_driver_device", default=None,
                     help="device of the test tensors: --ttt-device")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Before the plugin's own configure, which checks that the backend runs here."""
    if config.option.ttt_backend is None:
        config.option.ttt_backend = config.option.ttt_driver_backend
    if config.option.ttt_device is None:
        config.option.ttt_device = config.option.ttt_driver_device
