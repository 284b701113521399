"""The core's modules import one another without a cycle: no module needs, at import or
inside a function, one that needs it back."""

from __future__ import annotations

import ast
from pathlib import Path

import ttt

ROOT = Path(ttt.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` in ``package`` reads from, as an absolute name."""
    if not node.level:
        return node.module
    parts = package.split(".")
    base = parts[:len(parts) + 1 - node.level]
    return ".".join(base + [node.module] if node.module else base)


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere in its code: a submodule
    named in ``from X import name``, else ``X`` itself."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, package)
            names = {f"{source}.{alias.name}" for alias in node.names}
            found |= (names & modules) or {source}
    return (found & modules) - {name}


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in ROOT.rglob("*.py")}
    return {name: _imported(path, set(paths)) for name, path in paths.items()}


def _cycle_through(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from ``start`` back to itself, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for imported in graph[module]:
            if imported == start:
                return path + [start]
            if imported not in seen:
                seen.add(imported)
                stack.append((imported, path + [imported]))
    return None


def test_the_core_has_no_import_cycle():
    graph = _import_graph()
    assert "ttt.warmup" in graph and "ttt._warmup_workers" in graph["ttt.warmup"]
    cycles = [cycle for module in graph if (cycle := _cycle_through(module, graph))]
    assert not cycles, cycles
