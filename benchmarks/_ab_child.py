"""The measuring side of ``compare.py``: one child process per tree, one JSON line per request.

``python -m benchmarks.compare --serve SIDE --tree DIR ...`` runs :func:`serve` with the
tree's packages first on ``PYTHONPATH``: it checks where ``ttt``, ``ttt_triton`` and
``ttt_cupy`` come from, says hello (versions, device, backends), then answers each request of
stdin (``{"op": NAME, ...}``: a method of :class:`Child`) with one line of JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks import run

PACKAGES = {"ttt": "packages/ttt/src", "ttt_triton": "packages/ttt-triton/src",
            "ttt_cupy": "packages/ttt-cupy/src"}
"""Each package's module name -> its source folder inside a tree."""
CROSS_FACTOR = 2.0
"""Head against base: bound = CROSS_FACTOR x the dtype's tolerance against the oracle (two
results each within the tolerance of the same float64 answer differ by at most that much)."""


def import_problems(tree: Path) -> list[str]:
    """Why this process's ttt packages are not the ones of ``tree`` (empty: they are)."""
    import importlib.util

    problems = []
    for module_name, src in PACKAGES.items():
        if module_name in sys.modules:                  # imported already (ttt, by run)
            origin = sys.modules[module_name].__file__
        else:                                           # where it would come from
            spec = importlib.util.find_spec(module_name)
            origin = spec.origin if spec is not None else None
        if origin is None:
            if (tree / src / module_name).is_dir():
                problems.append(f"{module_name} is in {tree / src} but not found")
            continue
        where = Path(origin).resolve()
        if not where.is_relative_to((tree / src).resolve()):
            problems.append(f"{module_name} comes from {where}, not from {tree / src}")
    return problems


def tolerance_table() -> dict[str, list[float]]:
    """This process's ttt's bounds against the float64 oracle, ``{dtype name (run.DTYPES):
    [outputs, gradients]}``. The parent passes the head's table to both children, so both
    sides are judged by one table, whatever the base revision ships."""
    import importlib

    for module_name in ("ttt.tolerances", "ttt.testing.tolerances"):
        try:
            table = importlib.import_module(module_name).TOLERANCES
        except ImportError:
            continue
        return {name: list(table[dtype]) for name, dtype in run.DTYPES.items()}
    raise ImportError("this ttt has no tolerance table (ttt.tolerances or "
                      "ttt.testing.tolerances)")


class Child:
    """The measuring side of one tree: answers one JSON request per line (see ``serve``)."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.torch = torch
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cpu":
            torch.set_num_threads(1)     # two sides' thread pools would fight over the cores
        self.dtype = run.DTYPES[args.dtype]
        self.tolerances = json.loads(args.tolerances)
        self.providers: dict[str, object] = {}

    def hello(self) -> dict:
        import ttt
        from benchmarks._providers import discover

        torch = self.torch
        versions = {"python": sys.version.split()[0], "torch": torch.__version__,
                    "cuda": torch.version.cuda or "none",
                    "ttt": getattr(ttt, "__version__", "unknown")}
        for name in ("triton", "cupy"):
            try:
                versions[name] = __import__(name).__version__
            except Exception:  # noqa: BLE001 - absent or broken: a version string says so
                versions[name] = "absent"
        if self.device.type == "cuda":
            device_name = torch.cuda.get_device_name(self.device)
        else:
            device_name = "CPU (times are a smoke test, not a benchmark)"
        found = discover(self.args.backends, self.args.chunk_size)
        self.providers = {p.name.removeprefix("ttt."): p for p in found.providers}
        return {"ttt_file": ttt.__file__, "versions": versions, "device_name": device_name,
                "driver": run._driver_version() if self.device.type == "cuda" else None,
                "backends": sorted(self.providers), "skipped": found.skipped}

    def check(self, backend: str) -> dict:
        """``run.correctness`` of ``backend`` on the small shape, judged by the parent's
        tolerance table."""
        tol = self.tolerances
        shape = run.CHECK_SHAPE_CPU if self.device.type == "cpu" else run.CHECK_SHAPE_CUDA
        result = run.correctness(self.providers[backend], shape, self.args, self.device)
        bounds = {"o_fp32": tol["fp32"][0], "o_bf16": tol["bf16"][0]}
        errors = {k: result[k] for k in bounds if k in result}
        for name, value in result.get("grads_fp32", {}).items():
            errors[f"{name}_fp32"] = value
            bounds[f"{name}_fp32"] = tol["fp32"][1]
        failed = [f"{k} {v:.2g} > {bounds[k]:.2g}" for k, v in errors.items()
                  if not v <= bounds[k]]
        if "o_fp32" not in errors:
            failed.append(f"fp32 not checked: {result['status']}")
        return {"shape": result["shape"], "errors": errors,
                "bounds": {k: bounds[k] for k in errors}, "failed": failed,
                "note": "" if result["status"] == "ok" else result["status"]}

    def dump(self, backend: str, shape: list[int], path: str) -> dict:
        """``o`` and the six gradients on the timed inputs of ``shape``, saved to ``path``."""
        torch = self.torch
        shape = tuple(shape)
        provider = self.providers[backend]
        leaves = run._grad_leaves(run.make_inputs(shape, self.dtype, self.device,
                                                  self.args.seed))
        reason = provider.support(*leaves, chunk_size=self.args.chunk_size)
        if reason:
            return {"status": f"unsupported: {reason}"}
        o = provider.fn(*leaves)
        grads = ()
        if not self.args.fwd_only:
            do = run.make_cotangent(shape, self.dtype, self.device, self.args.seed)
            grads = torch.autograd.grad(o, leaves, grad_outputs=do)
        names = ("o", "dq", "dk", "dv", "dw", "db", "deta")
        torch.save({n: t.detach().cpu() for n, t in zip(names, (o, *grads))}, path)
        del leaves, o, grads
        run._free(self.device)
        return {"status": "ok"}

    def diff(self, mine: str, theirs: str) -> dict:
        """Relative difference of each tensor of dump ``mine`` from dump ``theirs``."""
        torch = self.torch
        a, b = torch.load(mine), torch.load(theirs)
        out_tol, grad_tol = self.tolerances[self.args.dtype]
        errors = {n: run._rel(a[n], b[n]) for n in a}
        bounds = {n: CROSS_FACTOR * (out_tol if n == "o" else grad_tol) for n in a}
        failed = [f"{n} {errors[n]:.2g} > {bounds[n]:.2g}" for n in a
                  if not errors[n] <= bounds[n]]
        return {"errors": errors, "bounds": bounds, "failed": failed}

    def host(self, backend: str, shape: list[int]) -> dict:
        """``run.host_times``: host ms per forward and backward, wall ms per both."""
        provider = self.providers[backend]
        xs = run.make_inputs(tuple(shape), self.dtype, self.device, self.args.seed)
        reason = provider.support(*xs, chunk_size=self.args.chunk_size)
        del xs
        if reason:
            return {"status": f"unsupported: {reason}"}
        fwd, bwd, wall = run.host_times(
            backend, tuple(shape), self.args.iters, self.args.host_warmup, self.dtype,
            self.args.chunk_size, self.device)
        return {"host_fwd_ms": fwd, "host_bwd_ms": bwd, "wall_ms": wall, "status": "ok"}

    def time(self, backend: str, shape: list[int]) -> dict:
        row = run.measure(self.providers[backend], tuple(shape), self.args, self.device)
        run._free(self.device)
        return {"fwd_ms": row.fwd_ms, "fwdbwd_ms": row.fwdbwd_ms, "status": row.status}


def serve(args: argparse.Namespace) -> int:
    """Child: check the imports, then answer each JSON request of stdin on one line."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                   # anything else printed goes to stderr, not the protocol
    problems = import_problems(args.tree)
    if problems:
        print(f"compare.py ({args.serve} side): wrong packages: " + "; ".join(problems),
              file=sys.stderr)
        return 3
    child = Child(args)

    def reply(payload: dict) -> None:
        protocol.write(json.dumps(payload) + "\n")
        protocol.flush()

    reply(child.hello())
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            reply(getattr(child, op)(**request))
        except Exception as exc:  # noqa: BLE001 - the parent records it in the cell
            reply({"error": run._short_error(exc)})
    return 0
