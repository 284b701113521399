"""The benchmarks a user runs, as modules from the repository root: ``python -m
benchmarks.run``, ``benchmarks.decode``, ``benchmarks.cold_start``, ``benchmarks.compare``
(benchmarks/README.md). The ``_``-named modules are their helpers."""
