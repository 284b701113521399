"""The automatic choice does not import a backend that is not installed on every call: it
tries again after ``registry.RETRY_IMPORT_S`` seconds or once ``sys.path`` changed."""

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
    monkeypatch.setitem(registry.KNOWN_BACKENDS, "ghost", registry.KnownBackend(
        f"{GHOST}:Backend", "pip install ghost", -1))
    monkeypatch.delitem(registry._LOADED, "ghost", raising=False)
    yield imports, now
    registry._LOADED.pop("ghost", None)


def _problem():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    return ttt.make_problem(q, k, v, 1 + 0.1 * torch.randn(2, 8, generator=gen),
                            0.1 * torch.randn(2, 8, generator=gen),
                            0.1 * torch.rand(1, 16, 2, 1, generator=gen))


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
