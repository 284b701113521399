"""Maintainers' measuring and profiling tools, as modules from the repository root:
``python -m tools.NAME`` (tools/README.md)."""
