"""Conformance suite fixtures: the backend under test and the device, from the command line.

    pytest shared_tests --backend triton [--device cuda] [-m "not big"]

The report header names the backend, its versions and the device.
"""

from __future__ import annotations

import os
import platform

import pytest
import torch

import ttt


def pytest_addoption(parser):
    parser.addoption("--backend", default=os.environ.get("TTT_TEST_BACKEND", "reference"),
                     help="ttt backend to test (default: reference, or $TTT_TEST_BACKEND)")
    parser.addoption("--device", default=None,
                     help="device for the test tensors (default: cuda when the backend "
                          "runs there and a GPU is present, else cpu)")


def _device_for(config) -> str:
    chosen = config.getoption("--device")
    if chosen:
        return chosen
    backend = ttt.load_backend(config.getoption("--backend"))
    if "cuda" in backend.capabilities.devices and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def pytest_report_header(config):
    name = config.getoption("--backend")
    try:
        backend = ttt.load_backend(name)
    except ImportError as exc:
        return [f"ttt backend: {name} (NOT LOADABLE: {exc})"]
    device = _device_for(config)
    where = device
    if device.startswith("cuda") and torch.cuda.is_available():
        where += f" ({torch.cuda.get_device_name(torch.device(device))})"
    versions = ", ".join(f"{k} {v}" for k, v in backend.versions().items())
    why = backend.unavailable_reason()
    return [f"ttt backend: {name} [{versions}]" + (f" UNAVAILABLE: {why}" if why else ""),
            f"ttt {ttt.__version__}, torch {torch.__version__}, python "
            f"{platform.python_version()}, device: {where}"]


@pytest.fixture(scope="session")
def backend_name(pytestconfig) -> str:
    return pytestconfig.getoption("--backend")


@pytest.fixture(scope="session")
def backend(backend_name) -> ttt.Backend:
    return ttt.load_backend(backend_name)


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    return torch.device(_device_for(pytestconfig))
