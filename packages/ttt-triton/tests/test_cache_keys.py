"""Triton's cache key of each kernel is the same in every process, whatever order the
kernels first launch in, so a second process finds what the first compiled in Triton's
disk cache. Triton 3.6 adds the global ``tl.constexpr`` values a called helper reads to its
caller's key only when the helper's own key was computed first (a kernel's key then
depended on which kernels a process launched before it): so no JIT function of ours reads
one."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys

import triton.language as tl

import ttt_triton.ops.ttt_linear as kernels


def _kernel_modules():
    return [importlib.import_module(f"{kernels.__name__}.{info.name}")
            for info in pkgutil.iter_modules(kernels.__path__)]


def _jit_functions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def test_no_jit_function_reads_a_global_constexpr():
    found = []
    for module in _kernel_modules():
        constexprs = {name for name, value in vars(module).items()
                      if isinstance(value, tl.constexpr)}
        for fn in _jit_functions(ast.parse(inspect.getsource(module))):
            used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} & constexprs
            found += [f"{module.__name__}.{fn.name} reads {name}" for name in sorted(used)]
    assert not found, f"write these constants as literals or parameters: {found}"


_KEYS_IN_ORDER = """
import importlib, pkgutil, sys
from triton.runtime.jit import JITFunction
import ttt_triton.ops.ttt_linear as kernels
found = {}
for info in pkgutil.iter_modules(kernels.__path__):
    module = importlib.import_module(f"{kernels.__name__}.{info.name}")
    found.update((f"{fn.fn.__module__}.{fn.fn.__qualname__}", fn) for fn in vars(module).values()
                 if isinstance(fn, JITFunction) and fn.fn.__name__.endswith("_kernel"))
order = sorted(found, reverse=sys.argv[1] == "reversed")
keys = {name: found[name].cache_key for name in order}
print(len(keys), *sorted(keys.items()))
"""


def test_kernel_cache_keys_do_not_depend_on_the_order_they_are_computed_in():
    """Each kernel's key, computed in a fresh process (compiler mode, not the interpreter)
    in two orders of the kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    keys = [subprocess.run([sys.executable, "-c", _KEYS_IN_ORDER, order], env=env,
                           capture_output=True, text=True, check=True).stdout
            for order in ("sorted", "reversed")]
    assert int(keys[0].split()[0]) >= 5       # the five kernels (at least) were found
    assert keys[0] == keys[1]
