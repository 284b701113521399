"""ttt's conformance suite, shipped with the package.

Run it on any installed backend (built in, or registered in the entry-point group
``ttt.backends``)::

    pytest --pyargs ttt.testing --ttt-backend NAME [--ttt-device cuda] [-m "not big"]

It judges by the float64 oracle :mod:`ttt.oracle` (TTT-Linear and TTT-MLP from their
definitions) and the bounds of :mod:`ttt.tolerances`; ``test_mlp`` checks the op
``"ttt_mlp"``, the other modules ``"ttt_linear"`` (the plugin skips an op a backend does not
declare). Modules: ``cases`` (shapes, dtypes, options, inputs),
``expected`` (the oracle's answer per case, computed once), ``calls`` (the backend through
the public op, skips with its reasons), ``compare`` (whole, per-sequence and per-chunk
errors), ``plugin`` (the pytest plugin: options, fixtures, header, skip summary) and the
``test_*`` modules (:func:`suite_tests` binds all their tests in another test module).
Importing this package imports nothing else.
"""


def suite_tests() -> dict[str, object]:
    """Every public name of the suite's test modules (each ``ttt.testing.test_*``: its tests
    and fixtures), as ``from ttt.testing.test_x import *`` of each would bind them. A test
    module outside this package collects the whole suite, modules added later included, with
    ``globals().update(ttt.testing.suite_tests())``; fixtures it defines after that line
    (``ttt_backend``, ``ttt_backend_name``, ``ttt_device``) take the plugin's place for its
    tests. RuntimeError where two modules define one test name."""
    import importlib
    import pkgutil

    found: dict[str, object] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if not info.name.startswith("test_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, value in vars(module).items():
            if name.startswith("test") and found.get(name, value) is not value:
                raise RuntimeError(f"ttt.testing: two test modules define {name!r}")
            if not name.startswith("_"):
                found[name] = value
    return found
