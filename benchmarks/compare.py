"""Same-run A/B of two revisions of the ttt packages on one GPU: base against head.

    python -m benchmarks.compare --base main                       # main -> this checkout
    python -m benchmarks.compare --base-tree .ab/base --backends cupy --shapes 8,2048,12,64
    python -m benchmarks.compare --base main --head my-branch --rounds 5 --out /tmp/ab
    python -m benchmarks.compare --base main --device cpu --quick  # no GPU: checks the path

Each side is a ``packages/`` tree: ``--base REV`` / ``--head REV`` extract git revision
``REV``'s (``git archive REV packages``) into a temporary folder, ``--base-tree DIR`` /
``--head DIR`` take a folder holding one, and the head is this checkout by default. Each side
runs in a child process whose ``PYTHONPATH`` starts with that tree's
``packages/{ttt,ttt-triton,ttt-cupy}/src`` (ahead of the editable installs); the child checks
that ``ttt`` (and ``ttt_triton``, ``ttt_cupy``) come from its tree and exits otherwise. The
measuring code is this checkout's ``benchmarks/`` (``run.measure``: the same inputs, timing
and budget as ``run.py``) on both sides: only the packages differ. Of a side's ``ttt`` it uses
only what every revision with ``ttt.chunk_ttt_linear`` has (a revision without
``ttt.make_problem`` runs each call unchecked: what it refuses is an error in its cell), and
both sides are judged by this checkout's tolerance table.

The two children take turns, cell by cell, for ``--rounds`` rounds (base first in even
rounds, head first in odd ones), so that a drift of the clocks or of the machine's load hits
both sides. Per backend, shape and pass (fwd, fwd+bwd) the table shows each side's median
over the rounds of ``run.measure``'s median, its spread (min-max over the rounds), the ratio
head/base and whether the two spreads overlap (then the ratio is within the noise).
``--host`` times ``run.host_times`` instead: the host ms of one forward and of one
backward (until the call returns) and the wall ms of both.

Correctness, before any timing: each side runs ``run.correctness`` (``o`` and the six
gradients with float32 inputs, ``o`` with bfloat16 inputs, against that side's reference
backend in float64, on a small shape) judged by the suite's ``TOLERANCES``; and per backend
and timed shape, the head's ``o`` and gradients on the timed inputs (same seed, ``--dtype``)
are compared with the base's: within twice the dtype's tolerance, the most two results
within the tolerance of the same float64 answer can differ by.

Exit status: 0 when every cell was measured on both sides (or is unsupported by both) and
every check passed; 1 when a check failed, a side raised an error, a cell was measured on one
side only or a backend is missing on a side; 2 when it cannot run (no CUDA device, a bad
revision or tree, a side whose packages do not come from its tree, a child process that
died). See benchmarks/README.md, "Comparing two revisions".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks import _ab_child, _ab_report, run
from benchmarks._ab_report import SIDES

REPO = Path(__file__).resolve().parents[1]
PASSES = (("fwd", "fwd_ms"), ("fwd+bwd", "fwdbwd_ms"))
HOST_PASSES = (("host fwd", "host_fwd_ms"), ("host bwd", "host_bwd_ms"),
               ("wall fwd+bwd", "wall_ms"))
"""--host: run.host_times' three figures."""
DEFAULT_BACKENDS = {"cuda": ["triton", "cupy"], "cpu": ["reference"]}
DEFAULT_DTYPE = {"cuda": "bf16", "cpu": "fp32"}


class UsageError(Exception):
    """A bad revision, tree or option, or a child that died: on stderr, exit status 2."""


# ----------------------------------------------------------------------------- the two trees


@dataclasses.dataclass
class Side:
    name: str            # "base" or "head"
    tree: Path           # a folder holding packages/
    label: str           # what the header says: the revision and its hash, or the folder


def _git(*argv: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0:
        raise UsageError(f"git {' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def extract_revision(rev: str, into: Path) -> Path:
    """``packages/`` of git revision ``rev`` (``git archive REV packages``), under ``into``."""
    _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "packages"],
                             capture_output=True, check=True, timeout=120).stdout
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def check_tree(tree: Path, option: str) -> Path:
    """``tree`` resolved, when it holds ``packages/ttt/src/ttt``; UsageError otherwise."""
    tree = tree.expanduser().resolve()
    if not (tree / _ab_child.PACKAGES["ttt"] / "ttt" / "__init__.py").is_file():
        raise UsageError(f"{option}: expected a folder holding packages/ttt/src/ttt "
                         f"(e.g. from git archive REV packages | tar -x -C DIR), got {tree}")
    return tree


def _tree_label(tree: Path) -> str:
    """The folder, and the revision its REVISION file names (written when it was made)."""
    stamp = tree / "REVISION"
    if stamp.is_file():
        return f"{tree} (REVISION: {stamp.read_text().strip()[:80]})"
    return str(tree)


def _checkout_label() -> str:
    commit, dirty = run._git_commit()
    state = {True: ", with uncommitted changes", False: "", None: ""}[dirty]
    return f"this checkout {REPO} ({commit}{state})"


def resolve_sides(args: argparse.Namespace, scratch: Path) -> list[Side]:
    if args.base_tree is not None:
        tree = check_tree(args.base_tree, "--base-tree")
        base = Side("base", tree, _tree_label(tree))
    else:
        tree = extract_revision(args.base, scratch / "base")
        base = Side("base", tree, f"{args.base} ({_git('rev-parse', args.base)})")
    if args.head is None:
        head = Side("head", REPO, _checkout_label())
    elif Path(args.head).is_dir():
        tree = check_tree(Path(args.head), "--head")
        head = Side("head", tree, _tree_label(tree))
    else:
        tree = extract_revision(args.head, scratch / "head")
        head = Side("head", tree, f"{args.head} ({_git('rev-parse', args.head)})")
    return [base, head]


# ----------------------------------------------------------------------------- the children


class SideProcess:
    """A running child for one side."""

    def __init__(self, side: Side, args: argparse.Namespace, backends: list[str]):
        self.side = side
        env = dict(os.environ)
        srcs = [str(side.tree / src) for src in _ab_child.PACKAGES.values()]
        env["PYTHONPATH"] = os.pathsep.join(srcs + [p for p in [env.get("PYTHONPATH")] if p])
        if args.device == "cpu" and "triton" in backends:
            env["TRITON_INTERPRET"] = "1"     # the only way triton runs without a GPU
        argv = [sys.executable, "-m", "benchmarks.compare", "--serve", side.name,
                "--tree", str(side.tree), "--device", args.device, "--dtype", args.dtype,
                "--chunk-size", str(args.chunk_size), "--seed", str(args.seed),
                "--warmup", str(args.warmup), "--rep", str(args.rep),
                "--min-iters", str(args.min_iters), "--iters", str(args.iters),
                "--host-warmup", str(args.host_warmup),
                "--tolerances", json.dumps(_ab_child.tolerance_table()), "--backends", *backends]
        if args.fwd_only:
            argv.append("--fwd-only")
        self.proc = subprocess.Popen(argv, env=env, text=True, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=REPO)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise UsageError(f"the {self.side.name} side's child process ({self.side.tree}) "
                             f"ended with exit status {self.proc.wait()}; its stderr is above")
        return json.loads(line)

    def ask(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cross_checks(children: list[SideProcess], backends: list[str], shapes, scratch: Path,
                 ) -> dict[tuple[str, tuple], dict]:
    """Per (backend, shape): the head's outputs and gradients against the base's."""
    results = {}
    for backend in backends:
        for shape in shapes:
            paths = [str(scratch / f"{c.side.name}.pt") for c in children]
            dumps = [c.ask("dump", backend=backend, shape=list(shape), path=p)
                     for c, p in zip(children, paths)]
            texts = [d.get("error") or d["status"] for d in dumps]
            if texts == ["ok", "ok"]:
                results[backend, shape] = children[1].ask("diff", mine=paths[1],
                                                          theirs=paths[0])
            elif texts[0] == texts[1] and texts[0].startswith("unsupported"):
                results[backend, shape] = {"failed": [], "note": "unsupported by both"}
            else:          # an error, or a result on one side only: nothing to compare
                results[backend, shape] = {"failed": [f"{name}: {text}" for name, text
                                                      in zip(SIDES, texts) if text != "ok"]}
            for path in paths:
                Path(path).unlink(missing_ok=True)
    return results


def passes(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, reply key) of each figure a cell reports."""
    chosen = HOST_PASSES if args.host else PASSES
    return [(label, key) for label, key in chosen
            if not (args.fwd_only and key == "fwdbwd_ms")]


def time_rounds(children: list[SideProcess], backends: list[str], shapes,
                args: argparse.Namespace) -> dict[tuple[str, tuple], list[list[dict]]]:
    """Per (backend, shape): [base's replies, head's replies], one per round, in turns."""
    samples = {(b, s): [[], []] for b in backends for s in shapes}
    op, rounds = ("host" if args.host else "time"), args.rounds
    for r in range(rounds):
        for backend in backends:
            for shape in shapes:
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    reply = children[i].ask(op, backend=backend, shape=list(shape))
                    samples[backend, shape][i].append(reply)
                    figures = ", ".join(f"{label} {run._report.fmt(reply.get(key))} ms"
                                        for label, key in passes(args))
                    _log(f"round {r + 1}/{rounds} {children[i].side.name} {backend} "
                         f"{shape}: {figures} [{reply.get('error') or reply.get('status')}]")
    return samples


def summarise(replies: list[dict], key: str) -> dict | None:
    """Median and min-max over the rounds of one side's ``key``; None if a round failed."""
    values = [r.get(key) for r in replies]
    if not values or any(v is None for v in values):
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": values}


def build_rows(samples, checks_cross, args) -> list[dict]:
    rows = []
    for (backend, shape), (base, head) in samples.items():
        cross = checks_cross.get((backend, shape), {})
        for label, key in passes(args):
            b, h = summarise(base, key), summarise(head, key)
            row = {"backend": backend, "shape": ",".join(map(str, shape)), "pass": label,
                   "base": b, "head": h, "ratio": None, "overlap": None,
                   "cross_check": cross,
                   "status": _cell_status(base, head)}
            if b and h:
                row["ratio"] = h["median"] / b["median"]
            if b and h and args.rounds > 1:
                row["overlap"] = h["min"] <= b["max"] and b["min"] <= h["max"]
            errored = any(r.get("error") or r.get("status", "").startswith("error")
                          for r in base + head)
            row["failed"] = errored or (b is None) != (h is None)
            rows.append(row)
    return rows


def _cell_status(base: list[dict], head: list[dict]) -> str:
    """'ok', or what went otherwise: once for both sides when they say the same."""
    bad = [sorted({r.get("error") or r["status"] for r in replies
                   if r.get("error") or r.get("status") != "ok"}) for replies in (base, head)]
    if bad[0] == bad[1]:
        return "; ".join(f"both: {text}" for text in bad[0]) or "ok"
    return "; ".join(f"{name}: {text}" for name, texts in zip(SIDES, bad) for text in texts)


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    base = p.add_mutually_exclusive_group()
    base.add_argument("--base", metavar="REV", help="git revision of the base side")
    base.add_argument("--base-tree", type=Path, metavar="DIR",
                      help="a folder holding the base's packages/ (a copy without .git)")
    p.add_argument("--head", metavar="DIR_OR_REV",
                   help="a folder holding packages/, or a git revision (default: this "
                        "checkout)")
    p.add_argument("--shapes", nargs="+", type=run.parse_shape, metavar="B,T,H,D",
                   help="default: run.py's anchor shapes (one tiny shape with --quick)")
    p.add_argument("--backends", nargs="+", metavar="NAME",
                   help="ttt backends (default: triton cupy; reference with --device cpu)")
    p.add_argument("--dtype", choices=sorted(run.DTYPES),
                   help="default bf16 (fp32 with --device cpu)")
    p.add_argument("--chunk-size", type=int, default=16, help="default 16")
    p.add_argument("--rounds", type=int, default=3, help="turns of the two sides (default 3)")
    p.add_argument("--fwd-only", action="store_true", help="skip the fwd+bwd timings")
    p.add_argument("--quick", action="store_true", help="tiny shapes, short timings")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu only with --quick: checks the path, the times mean nothing")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--warmup", type=float, help="ms per measurement (run.py's default)")
    p.add_argument("--rep", type=float, help="ms per measurement (run.py's default)")
    p.add_argument("--min-iters", type=int, help="fewest timed calls (run.py's default)")
    p.add_argument("--host", action="store_true",
                   help="time run.host_times instead: host ms of one forward and "
                        "of one backward (until the call returns), wall ms of both")
    p.add_argument("--iters", type=int,
                   help="with --host: calls per measurement (default 20; 3 with --quick)")
    p.add_argument("--host-warmup", type=int,
                   help="with --host: untimed calls first (default 3; 1 with --quick)")
    p.add_argument("--out", type=Path, help="also write compare.md and compare.json here")
    p.add_argument("--serve", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tolerances", default="{}", help=argparse.SUPPRESS)
    return p


def _complete(args: argparse.Namespace) -> None:
    """Defaults that depend on other options; UsageError for bad combinations."""
    if args.base is None and args.base_tree is None:
        raise UsageError("give --base REV or --base-tree DIR")
    if args.device == "cpu" and not args.quick:
        raise UsageError("--device cpu only checks the path: add --quick")
    if args.host and args.fwd_only:
        raise UsageError("--fwd-only does not apply to --host (host_times times both passes)")
    if args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {args.rounds}")
    if args.chunk_size < 1:
        raise UsageError(f"--chunk-size must be positive, got {args.chunk_size}")
    args.dtype = args.dtype or DEFAULT_DTYPE[args.device]
    args.warmup = args.warmup if args.warmup is not None else (10.0 if args.quick else 50.0)
    args.rep = args.rep if args.rep is not None else (30.0 if args.quick else 300.0)
    args.min_iters = args.min_iters if args.min_iters is not None else (3 if args.quick else 10)
    args.iters = args.iters if args.iters is not None else (3 if args.quick else 20)
    args.host_warmup = args.host_warmup if args.host_warmup is not None else (
        1 if args.quick else 3)
    if args.iters < 1 or args.host_warmup < 0:
        raise UsageError(f"--iters must be at least 1 and --host-warmup at least 0, got "
                         f"{args.iters} and {args.host_warmup}")
    args.backends = [n for item in args.backends or DEFAULT_BACKENDS[args.device]
                     for n in item.split(",") if n.strip()]
    if not args.shapes:
        quick = run.QUICK_SHAPES_CPU if args.device == "cpu" else run.QUICK_SHAPES_CUDA
        args.shapes = quick if args.quick else run.SHAPES


def compare(args: argparse.Namespace) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("no CUDA device here; use --device cpu --quick to check the path")
    with tempfile.TemporaryDirectory(prefix="ttt-compare-") as tmp:
        scratch = Path(tmp)
        sides = resolve_sides(args, scratch)
        children = []
        try:
            for side in sides:
                children.append(SideProcess(side, args, args.backends))
                _log(f"{side.name}: ttt from {children[-1].hello['ttt_file']}")
            return _measure_and_report(args, children, scratch)
        finally:
            for child in children:
                child.close()


def _measure_and_report(args, children: list[SideProcess], scratch: Path) -> int:
    backends = [b for b in args.backends
                if all(b in c.hello["backends"] for c in children)]
    for child in children:
        for name, why in child.hello["skipped"].items():
            _log(f"{child.side.name}: skip {name}: {why}")
    if not backends:
        _log("compare.py: no backend runs on both sides; see the lines above")
        return 1
    oracle = []
    for backend in backends:
        for child in children:
            _log(f"check {child.side.name} {backend} against its float64 reference ...")
            check = child.ask("check", backend=backend)
            oracle.append({"side": child.side.name, "backend": backend,
                           "failed": [], **check})
    _log("compare head's outputs and gradients with base's on the timed shapes ...")
    cross = cross_checks(children, backends, args.shapes, scratch)
    samples = time_rounds(children, backends, args.shapes, args)
    rows = build_rows(samples, cross, args)

    failed = (any(c["failed"] or c.get("error") for c in oracle)
              or any(x.get("failed") or x.get("error") for x in cross.values())
              or any(r["failed"] for r in rows)
              or len(backends) < len(args.backends))
    hello = children[0].hello
    meta = {"device_name": hello["device_name"], "driver": hello["driver"],
            "sides": {c.side.name: {"label": c.side.label, "tree": str(c.side.tree),
                                    "ttt_file": c.hello["ttt_file"],
                                    "versions": c.hello["versions"]} for c in children},
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "dtype": args.dtype, "chunk_size": args.chunk_size, "seed": args.seed,
            "rounds": args.rounds, "backends": backends, "argv": sys.argv[1:],
            "timing": _timing_text(args), "oracle_checks": oracle,
            "exit_status": 1 if failed else 0}
    if args.out:
        _ab_report.write_outputs(args.out, meta, rows)
    print(_ab_report.report_text(meta, rows), end="")
    return meta["exit_status"]


def _timing_text(args: argparse.Namespace) -> str:
    if args.host:
        return (f"run.host_times: {args.iters} calls after {args.host_warmup} untimed; "
                f"host ms until each call returns, wall ms of fwd+bwd")
    if args.device == "cpu":
        return "wall clock on CPU: a check of the path, not a benchmark"
    return (f"run.measure: triton.testing.do_bench median, L2 flushed, warm-up "
            f"{args.warmup:g} ms, timed >= {args.rep:g} ms and >= {args.min_iters} calls")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve:
        return _ab_child.serve(args)
    try:
        _complete(args)
        return compare(args)
    except UsageError as exc:
        _log(f"compare.py: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
