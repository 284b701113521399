"""The automatic choice does not import a backend that is not installed on every call: it
tries again after ``registry.RETRY_IMPORT_S`` seconds or once ``sys.path`` changed. It keeps
its choice per problem signature as long, unless the backends known or loaded change."""

from __future__ import annotations

import textwrap

import pytest
import torch

import ttt
from ttt import registry

GHOST = "ttt_ghost_backend_module"


@pytest.fixture
def ghost(monkeypatch):
    """A known backend, first in the automatic choice, whose module is not installed; the
    imports of it counted, the clock in the test's hands."""
    imports = []
    real_import = registry.importlib.import_module

    def counting_import(name, *args):
        if name.startswith(GHOST):
            imports.append(name)
        return real_import(name, *args)

    now = [1000.0]
    monkeypatch.setattr(registry.importlib, "import_module", counting_import)
    monkeypatch.setattr(registry, "_clock", lambda: now[0])
    monkeypatch.setattr(registry, "_NOT_INSTALLED", {})
    monkeypatch.setattr(registry, "_KEPT", {})           # no automatic choice kept either
    monkeypatch.setitem(registry.KNOWN_BACKENDS, "ghost", registry.KnownBackend(
        f"{GHOST}:Backend", "pip install ghost", -1))
    monkeypatch.delitem(registry._LOADED, "ghost", raising=False)
    yield imports, now
    registry._LOADED.pop("ghost", None)


def _problem(T=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, 2, 8, generator=gen, dtype=dtype) for _ in range(3))
    return ttt.make_problem(q, k, v, 1 + 0.1 * torch.randn(2, 8, generator=gen, dtype=dtype),
                            0.1 * torch.randn(2, 8, generator=gen, dtype=dtype),
                            0.1 * torch.rand(1, T, 2, 1, generator=gen, dtype=dtype))


def test_a_missing_backend_is_imported_once_per_interval(ghost):
    imports, now = ghost
    problem = _problem()
    for _ in range(3):
        assert registry.select_backend(problem).name != "ghost"
    assert imports == [GHOST]
    now[0] += registry.RETRY_IMPORT_S
    registry.select_backend(problem)
    assert imports == [GHOST, GHOST]


def test_a_named_backend_is_always_imported_again(ghost):
    imports, _ = ghost
    registry.select_backend(_problem())
    for _ in range(2):
        with pytest.raises(registry.BackendNotInstalledError, match="pip install ghost"):
            registry.select_backend(_problem(), "ghost")
    assert imports == [GHOST] * 3


def test_the_reasons_stay_those_of_the_import(ghost):
    problem = _problem()
    registry.select_backend(problem)
    with pytest.raises(registry.BackendNotSupportedError) as first:
        registry.select_backend(problem.__class__(**{**problem.__dict__, "output": "no_such_form"}))
    assert f"ghost: not installed: module {GHOST!r} cannot be imported" in str(first.value)


def test_a_backend_installed_on_a_new_path_is_found_at_once(ghost, monkeypatch, tmp_path):
    imports, _ = ghost
    problem = _problem()
    registry.select_backend(problem)
    (tmp_path / f"{GHOST}.py").write_text(textwrap.dedent("""
        from ttt.reference import ReferenceBackend

        class Backend(ReferenceBackend):
            name = "ghost"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.select_backend(problem).name == "ghost"
    assert imports == [GHOST, GHOST]


class _Counting(ttt.Backend):
    """Takes float32 CPU problems; counts the times it is asked."""

    capabilities = ttt.Capabilities(devices=frozenset({"cpu"}),
                                    dtypes=frozenset({torch.float32}))

    def __init__(self, name: str):
        self.name = name
        self.asked = 0

    def not_supported_reasons(self, problem):
        self.asked += 1
        return super().not_supported_reasons(problem)


@pytest.fixture
def counting(monkeypatch):
    """A backend "counting" first in the automatic choice, loaded; the clock in the test's
    hands; no automatic choice kept."""
    now = [1000.0]
    backend = _Counting("counting")
    monkeypatch.setattr(registry, "_clock", lambda: now[0])
    monkeypatch.setattr(registry, "_KEPT", {})
    monkeypatch.delenv("TTT_BACKEND", raising=False)
    monkeypatch.setitem(registry.KNOWN_BACKENDS, "counting", registry.KnownBackend(
        "x:y", "pip install counting", -2))
    monkeypatch.setitem(registry._LOADED, "counting", backend)
    return backend, now


def test_the_automatic_choice_is_kept_per_signature_for_an_interval(counting):
    backend, now = counting
    problem = _problem()
    for _ in range(3):
        assert registry.select_backend(problem) is backend
    assert backend.asked == 1
    other = _problem(T=5)                      # another signature: asked again
    assert registry.select_backend(other) is backend
    assert backend.asked == 2
    now[0] += registry.RETRY_IMPORT_S          # the interval is over: asked again
    registry.select_backend(problem)
    assert backend.asked == 3


def test_a_kept_choice_is_never_one_the_problem_does_not_fit(counting):
    backend, _ = counting
    registry.select_backend(_problem())
    double = _problem(dtype=torch.float64)
    assert registry.select_backend(double).name == "reference"
    assert registry.select_backend(_problem()) is backend


def test_named_choices_bypass_the_kept_one(counting, monkeypatch):
    backend, _ = counting
    problem = _problem()
    assert registry.select_backend(problem) is backend
    assert registry.select_backend(problem, "reference").name == "reference"
    with ttt.set_backend("reference"):
        assert registry.select_backend(problem).name == "reference"
    monkeypatch.setenv("TTT_BACKEND", "reference")
    assert registry.select_backend(problem).name == "reference"
    monkeypatch.delenv("TTT_BACKEND")
    assert registry.select_backend(problem) is backend


def test_a_backend_registered_or_loaded_later_is_chosen_at_once(counting, monkeypatch):
    backend, _ = counting
    problem = _problem()
    assert registry.select_backend(problem) is backend
    earlier = _Counting("earlier")
    monkeypatch.setitem(registry.KNOWN_BACKENDS, "earlier", registry.KnownBackend(
        "x:z", "pip install earlier", -3))
    monkeypatch.setitem(registry._LOADED, "earlier", earlier)
    assert registry.select_backend(problem) is earlier
    replacement = _Counting("counting")
    monkeypatch.delitem(registry.KNOWN_BACKENDS, "earlier")
    monkeypatch.setitem(registry._LOADED, "counting", replacement)
    assert registry.select_backend(problem) is replacement
