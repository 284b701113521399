"""One exception family for "no such backend here": ``ttt.BackendError`` and its subclasses."""

from __future__ import annotations

import pytest
import torch

import ttt
from ttt import registry
from ttt.nn import TTTLinear
from ttt.reference import ReferenceBackend


def _inputs():
    q = torch.randn(1, 8, 2, 8)
    return dict(q=q, k=q, v=q, w=torch.ones(2, 8), b=torch.zeros(2, 8), eta=0.1)


class _Unavailable(ReferenceBackend):
    name = "offline"

    def unavailable_reason(self):
        return "its engine cannot start here"


class _Narrow(ReferenceBackend):
    name = "narrow"
    capabilities = ttt.Capabilities(devices=frozenset({"cpu"}),
                                    dtypes=frozenset({torch.float64}))


@pytest.fixture
def extra_backends(register):
    register("offline", _Unavailable())
    register("narrow", _Narrow())
    register("ghost", "ttt_ghost_backend_not_installed.backend:Backend",
             install_hint="pip install ghost", priority=5)


def test_the_family_is_exported_at_top_level():
    assert issubclass(ttt.BackendError, Exception)
    for cls, builtin in ((ttt.UnknownBackendError, ValueError),
                         (ttt.BackendNotInstalledError, ImportError),
                         (ttt.BackendUnavailableError, ValueError),
                         (ttt.BackendNotSupportedError, ValueError)):
        assert issubclass(cls, ttt.BackendError) and issubclass(cls, builtin), cls
        assert cls.__name__ in ttt.__all__
        assert getattr(registry, cls.__name__) is cls     # the old names are the same classes
    assert "BackendError" in ttt.__all__
    # existing code that caught BackendNotSupportedError for a backend that cannot run keeps
    # catching it
    assert issubclass(ttt.BackendUnavailableError, ttt.BackendNotSupportedError)


@pytest.mark.parametrize("name, expected", [
    ("no_such_backend", ttt.UnknownBackendError),
    ("ghost", ttt.BackendNotInstalledError),
    ("offline", ttt.BackendUnavailableError),
    ("narrow", ttt.BackendNotSupportedError),
])
def test_one_except_catches_every_no_such_backend_here(extra_backends, name, expected):
    with pytest.raises(expected):
        ttt.chunk_ttt_linear(**_inputs(), backend=name)
    try:
        ttt.chunk_ttt_linear(**_inputs(), backend=name)
    except ttt.BackendError as err:
        assert name in str(err)
    else:
        pytest.fail("no BackendError")


def test_set_backend_of_a_missing_backend_is_a_backend_error(extra_backends):
    with pytest.raises(ttt.BackendError, match="pip install ghost"):
        ttt.set_backend("ghost")
    with pytest.raises(ttt.BackendError, match="unknown backend"):
        ttt.set_backend("no_such_backend")


@pytest.mark.parametrize("name", ["triton", "cupy"])
def test_layer_on_a_kernel_backend_raises_a_backend_error(name):
    """Installed or not, runnable here or not: the layer's calls on a backend without
    eta_key raise a BackendError (docs/nn.md)."""
    layer = TTTLinear(16, 2, 4, backend=name)
    with pytest.raises(ttt.BackendError):
        layer(torch.randn(1, 5, 16))


def test_the_automatic_choice_with_nothing_fitting_is_a_backend_error(register):
    register("reference", _Narrow(), priority=1000, replace=True)
    with pytest.raises(ttt.BackendNotSupportedError, match="no ttt backend"):
        ttt.chunk_ttt_linear(**_inputs())


class _Engines(ReferenceBackend):
    name = "engines"
    engines = {"torch": "pip install torch",
               "ttt_engine_not_installed.core": "pip install ttt-engine"}


def test_engines_give_the_unavailable_reason_and_versions():
    backend = _Engines()
    reason = backend.unavailable_reason()
    assert "'ttt_engine_not_installed'" in reason and "pip install ttt-engine" in reason
    assert backend.versions() == {"torch": torch.__version__}
    assert ttt.Backend().unavailable_reason() is None and ttt.Backend().versions() == {}
