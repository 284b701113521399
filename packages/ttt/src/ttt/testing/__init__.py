"""ttt's conformance suite, shipped with the package, and the float64 oracle it judges by.

Run it on any installed backend (built in, or registered in the entry-point group
``ttt.backends``)::

    pytest --pyargs ttt.testing --ttt-backend NAME [--ttt-device cuda] [-m "not big"]

It judges by the float64 oracle :mod:`ttt.oracle` (TTT-linear from its definition) and the
bounds of :mod:`ttt.tolerances`; ``oracle`` and ``tolerances`` here re-export them.
Modules: ``cases`` (shapes, dtypes, options, inputs), ``expected`` (the oracle's answer per case,
computed once), ``calls`` (the backend through the public op, skips with its reasons),
``compare`` (whole, per-sequence and per-chunk errors), ``plugin`` (the pytest plugin:
options, fixtures, header, skip summary) and the ``test_*`` modules. Importing this package
imports nothing else.
"""
