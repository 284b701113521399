"""The automatic choice does not import a backend that is not installed on every call, and
keeps its choice per problem signature, until its caches are dropped: by ``set_backend``,
registering or unregistering a backend, or ``registry.clear_cache()``; never by time. A
backend asked for by name is kept so where it takes the problem; one that refuses it is
asked again, and raises, every time."""

from __future__ import annotations

import contextlib
import textwrap

import pytest
import torch

import ttt
from ttt import registry
from ttt.choice import select_backend

GHOST = "ttt_ghost_backend_module"


@pytest.fixture
def ghost(monkeypatch, register):
    """A registered backend, first in the automatic choice, whose module is not installed;
    the imports of it counted; a spare backend registered (last in the automatic choice);
    nothing kept of earlier choices."""
    imports = []
    real_import = registry.importlib.import_module

    def counting_import(name, *args):
        if name.startswith(GHOST):
            imports.append(name)
        return real_import(name, *args)

    monkeypatch.setattr(registry.importlib, "import_module", counting_import)
    register("ghost", f"{GHOST}:Backend", install_hint="pip install ghost", priority=-1)
    register("spare", _Counting("spare"), priority=2000)
    registry.clear_cache()
    return imports


def _problem(T=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, 2, 8, generator=gen, dtype=dtype) for _ in range(3))
    return ttt.make_problem(q, k, v, 1 + 0.1 * torch.randn(2, 8, generator=gen, dtype=dtype),
                            0.1 * torch.randn(2, 8, generator=gen, dtype=dtype),
                            0.1 * torch.rand(1, T, 2, 1, generator=gen, dtype=dtype))


def test_a_missing_backend_is_imported_once_until_the_cache_is_cleared(ghost):
    imports = ghost
    for T in (16, 5, 3):                       # new signatures: the choice runs each time
        assert select_backend(_problem(T)).name != "ghost"
    assert imports == [GHOST]
    registry.clear_cache()
    select_backend(_problem())
    assert imports == [GHOST, GHOST]


def _drop_kept_choices(drop: str, register) -> None:
    """What drops the kept choices: ``clear_cache``, ``set_backend``, registering a backend
    or unregistering one (the fixture's spare)."""
    if drop == "clear_cache":
        registry.clear_cache()
    elif drop == "set_backend":
        with ttt.set_backend(None):
            pass
    elif drop == "register":
        register("other", _Counting("other"), priority=2000)
    else:
        ttt.unregister_backend("spare")


@pytest.mark.parametrize("drop", ["set_backend", "register", "unregister"])
def test_set_backend_and_registration_drop_the_memo(ghost, register, drop):
    imports = ghost
    select_backend(_problem())
    assert imports == [GHOST]
    _drop_kept_choices(drop, register)
    select_backend(_problem())
    assert imports == [GHOST, GHOST]


def test_a_named_backend_is_always_imported_again(ghost):
    imports = ghost
    select_backend(_problem())
    for _ in range(2):
        with pytest.raises(registry.BackendNotInstalledError, match="pip install ghost"):
            select_backend(_problem(), "ghost")
    assert imports == [GHOST] * 3


def test_the_reasons_stay_those_of_the_import(ghost):
    problem = _problem()
    select_backend(problem)
    with pytest.raises(registry.BackendNotSupportedError) as first:
        select_backend(problem.__class__(**{**problem.__dict__, "output": "no_such_form"}))
    assert f"ghost: not installed: module {GHOST!r} cannot be imported" in str(first.value)


def test_a_backend_installed_later_is_found_once_the_cache_is_cleared(ghost, monkeypatch,
                                                                     tmp_path):
    imports = ghost
    problem = _problem()
    assert select_backend(problem).name != "ghost"
    (tmp_path / f"{GHOST}.py").write_text(textwrap.dedent("""
        from ttt.reference import ReferenceBackend

        class Backend(ReferenceBackend):
            name = "ghost"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert select_backend(problem).name != "ghost"      # kept: nothing dropped
    assert imports == [GHOST]
    registry.clear_cache()
    assert select_backend(problem).name == "ghost"
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
def counting(monkeypatch, register):
    """A backend "counting" first in the automatic choice, and a spare one last, both
    registered; no automatic choice kept."""
    backend = _Counting("counting")
    monkeypatch.delenv("TTT_BACKEND", raising=False)
    register("counting", backend, priority=-2)
    register("spare", _Counting("spare"), priority=2000)
    registry.clear_cache()
    return backend


def test_the_automatic_choice_is_kept_per_signature_until_dropped(counting):
    backend = counting
    problem = _problem()
    for _ in range(3):
        assert select_backend(problem) is backend
    assert backend.asked == 1
    other = _problem(T=5)                      # another signature: asked again
    assert select_backend(other) is backend
    assert backend.asked == 2
    registry.clear_cache()                     # dropped: asked again
    select_backend(problem)
    assert backend.asked == 3
    with ttt.set_backend(None):                # dropped by set_backend
        select_backend(problem)
    assert backend.asked == 4
    select_backend(problem)
    assert backend.asked == 4


def test_a_kept_choice_is_never_one_the_problem_does_not_fit(counting):
    backend = counting
    select_backend(_problem())
    double = _problem(dtype=torch.float64)
    assert select_backend(double).name == "reference"
    assert select_backend(_problem()) is backend


def test_named_choices_bypass_the_kept_one(counting, monkeypatch):
    backend = counting
    problem = _problem()
    assert select_backend(problem) is backend
    assert select_backend(problem, "reference").name == "reference"
    with ttt.set_backend("reference"):
        assert select_backend(problem).name == "reference"
    monkeypatch.setenv("TTT_BACKEND", "reference")
    assert select_backend(problem).name == "reference"
    monkeypatch.delenv("TTT_BACKEND")
    assert select_backend(problem) is backend


def test_a_backend_registered_or_replaced_later_is_chosen_at_once(counting, register):
    backend = counting
    problem = _problem()
    assert select_backend(problem) is backend
    earlier = _Counting("earlier")
    register("earlier", earlier, priority=-3)
    assert select_backend(problem) is earlier
    replacement = _Counting("counting")
    ttt.unregister_backend("earlier")
    register("counting", replacement, priority=-2, replace=True)
    assert select_backend(problem) is replacement


class _Refusing(_Counting):
    """Refuses every problem; counts the times it is asked."""

    def not_supported_reasons(self, problem):
        self.asked += 1
        return ["refuses everything"]


@pytest.mark.parametrize("how", ["argument", "set_backend", "environment"])
def test_a_named_backend_that_takes_the_problem_is_kept_per_signature(counting, monkeypatch,
                                                                      how):
    backend = counting
    requested = "counting" if how == "argument" else None
    if how == "environment":
        monkeypatch.setenv("TTT_BACKEND", "counting")
    with ttt.set_backend("counting") if how == "set_backend" else contextlib.nullcontext():
        for _ in range(3):
            assert select_backend(_problem(), requested) is backend
        assert backend.asked == 1
        assert select_backend(_problem(T=5), requested) is backend    # asked again
        assert backend.asked == 2


def test_a_named_backend_that_refuses_the_problem_raises_every_time(counting, register):
    refusing = _Refusing("refusing")
    register("refusing", refusing)
    problem = _problem()
    errors = []
    for _ in range(3):
        with pytest.raises(registry.BackendNotSupportedError) as info:
            select_backend(problem, "refusing")
        errors.append(str(info.value))
    assert refusing.asked == 3
    assert errors == [f"backend 'refusing' cannot take these inputs ({problem.describe()}): "
                      f"refuses everything"] * 3
    with ttt.set_backend("refusing"):
        for _ in range(2):
            with pytest.raises(registry.BackendNotSupportedError, match="refuses everything"):
                select_backend(problem)
    assert refusing.asked == 5


def test_a_named_backend_is_kept_apart_from_the_automatic_choice(counting):
    backend = counting
    problem = _problem()
    assert select_backend(problem, "reference").name == "reference"
    assert select_backend(problem) is backend
    assert select_backend(problem, "reference").name == "reference"
    assert select_backend(problem, "counting") is backend
    assert backend.asked == 2                  # once automatic, once by name


@pytest.mark.parametrize("drop", ["clear_cache", "set_backend", "register", "unregister"])
def test_kept_named_choices_are_dropped_with_the_automatic_ones(counting, register, drop):
    backend = counting
    problem = _problem()
    select_backend(problem, "counting")
    assert backend.asked == 1
    _drop_kept_choices(drop, register)
    select_backend(problem, "counting")
    assert backend.asked == 2


def test_a_named_backend_replaced_is_used_at_once(counting, register):
    problem = _problem()
    assert select_backend(problem, "counting") is counting
    refusing = _Refusing("counting")
    register("counting", refusing, priority=-2, replace=True)
    with pytest.raises(registry.BackendNotSupportedError, match="refuses everything"):
        select_backend(problem, "counting")
