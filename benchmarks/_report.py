"""Benchmark results: rows, the speed-up columns, and the four output files.

``results.json`` (metadata + rows), ``results.csv`` (rows), ``results.md`` (the table
people read), ``results.png`` (fwd+bwd time and speed-up per shape and provider) and
``environment.txt`` (the GPU, driver, versions, commit and command of the run).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass
class Row:
    shape: str                          # "B,T,H,D"
    B: int
    T: int
    H: int
    D: int
    dtype: str
    chunk_size: int
    provider: str
    status: str = "ok"                  # "ok", "unsupported: ...", "error: ..."
    fwd_ms: float | None = None         # median
    fwd_p20_ms: float | None = None
    fwd_p80_ms: float | None = None
    fwdbwd_ms: float | None = None      # median of one forward + autograd.grad of six inputs
    fwdbwd_p20_ms: float | None = None
    fwdbwd_p80_ms: float | None = None
    peak_mib: float | None = None       # extra device memory of one fwd+bwd
    step_us: float | None = None        # fwd_ms / number of chunks, in microseconds
    floor_us: float | None = None       # the chain step's floor (benchmarks.step_floor)
    chains_per_sm: float | None = None  # B * H chains over the GPU's SMs
    hbm_fwd: float | None = None        # minimal fwd bytes / fwd_ms / peak HBM bandwidth
    hbm_fwdbwd: float | None = None     # the same for fwd+bwd
    speedup_fwd: float | None = None    # fastest FLA variant's fwd median / this fwd median
    speedup_fwdbwd: float | None = None


def engine_versions(statuses: dict) -> str:
    """``name: engine version, ...; ...`` of ttt backends' statuses ({name: BackendStatus};
    ``-`` for one without versions): the engines line of the benchmarks' headers."""
    return "; ".join(f"{name}: " + (", ".join(f"{k} {v}" for k, v in s.versions.items())
                                    or "-") for name, s in statuses.items())


def add_speedups(rows: list[Row], fla_names: set[str]) -> None:
    """Fill the speed-up columns against the fastest FLA variant of the same shape."""
    for shape in dict.fromkeys(r.shape for r in rows):
        group = [r for r in rows if r.shape == shape]
        fla = [r for r in group if r.provider in fla_names]
        best_fwd = min((r.fwd_ms for r in fla if r.fwd_ms), default=None)
        best_fb = min((r.fwdbwd_ms for r in fla if r.fwdbwd_ms), default=None)
        for r in group:
            if best_fwd and r.fwd_ms:
                r.speedup_fwd = best_fwd / r.fwd_ms
            if best_fb and r.fwdbwd_ms:
                r.speedup_fwdbwd = best_fb / r.fwdbwd_ms


def fmt(x: float | None) -> str:
    """Three significant figures, never scientific above 1e-4: 0.392, 3.78, 55.3, 1542."""
    if x is None or math.isnan(x):
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _fmt_speedup(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown_table(rows: list[Row]) -> str:
    head = ("| B, T, H, D | provider | fwd ms | fwd+bwd ms | speed-up fwd | speed-up fwd+bwd "
            "| peak MiB | step us | floor us | HBM fwd | HBM fwd+bwd | chains/SM | status |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        shape = r.shape.replace(",", ", ")
        peak = "-" if r.peak_mib is None else f"{r.peak_mib:.0f}"
        status = r.status.replace("|", "/").replace("\n", " ")
        if len(status) > 120:
            status = status[:117] + "..."
        lines.append(f"| {shape} | {r.provider} | {fmt(r.fwd_ms)} | {fmt(r.fwdbwd_ms)} | "
                     f"{_fmt_speedup(r.speedup_fwd)} | {_fmt_speedup(r.speedup_fwdbwd)} | "
                     f"{peak} | {fmt(r.step_us)} | {fmt(r.floor_us)} | {_pct(r.hbm_fwd)} | "
                     f"{_pct(r.hbm_fwdbwd)} | {fmt(r.chains_per_sm)} | {status} |")
    return "\n".join(lines)


def checks_table(checks: list[dict]) -> str:
    if not checks:
        return ""
    lines = ["| provider | shape | o rel err fp32 | worst grad rel err fp32 | o rel err bf16 "
             "| status |", "|" + "---|" * 6]
    for c in checks:
        lines.append(f"| {c['provider']} | {c['shape'].replace(',', ', ')} | "
                     f"{_fmt_err(c.get('o_fp32'))} | {_fmt_err(c.get('grad_fp32'))} "
                     f"({c.get('worst_grad') or '-'}) | {_fmt_err(c.get('o_bf16'))} | "
                     f"{c.get('status', 'ok')} |")
    return "\n".join(lines)


def _fmt_err(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def header_text(meta: dict) -> str:
    lines = [f"# ttt benchmark: {meta['device_name']}",
             "",
             f"torch {meta['torch']} (CUDA {meta['cuda']}), triton {meta['triton']}, "
             f"fla-core {meta['fla'] or 'absent'}, ttt {meta['ttt']}, "
             f"commit {meta['commit']}, {meta['date']}",
             f"dtype {meta['dtype']}, chunk size {meta['chunk_size']}, timing: {meta['timing']}"]
    if meta.get("partial"):
        lines.append(f"- PARTIAL: {meta['partial']} shapes measured so far (written after "
                     "each shape; a finished run overwrites this)")
    for name, why in meta.get("skipped", {}).items():
        lines.append(f"- not benchmarked: {name}: {why}")
    if meta.get("fla_absent"):
        lines.append(f"- FLA not benchmarked: {meta['fla_absent']}; speed-up columns are empty")
    return "\n".join(lines)


def environment_text(meta: dict) -> str:
    """The run's environment, one fact a line: GPU and driver, versions, commit, command."""
    gpu = meta["device_name"]
    if meta.get("sm_count"):
        gpu += f" ({meta['sm_count']} SMs, {meta['device_memory_gib']} GiB)"
    if meta.get("driver"):
        gpu += f", driver {meta['driver']}"
    engines = "; ".join(f"{name}: " + ", ".join(f"{k} {v}" for k, v in versions.items())
                        for name, versions in meta.get("backend_versions", {}).items())
    dirty = " (uncommitted changes)" if meta.get("commit_dirty") else ""
    return "\n".join([
        f"GPU: {gpu}",
        f"python {meta['python']}, torch {meta['torch']} (CUDA {meta['cuda']}), "
        f"triton {meta['triton']}, fla-core {meta['fla'] or 'absent'}, ttt {meta['ttt']}",
        f"providers: {engines}",
        f"commit: {meta['commit']}{dirty}",
        f"date: {meta['date']}",
        "command: python -m benchmarks.run " + " ".join(meta.get("argv", [])),
    ]) + "\n"


def write_all(out: Path, rows: list[Row], meta: dict, checks: list[dict],
              plot: bool = True) -> list[Path]:
    """Write results.{json,csv,md,png} and environment.txt into ``out``; returns the paths
    written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []

    path = out / "results.json"
    path.write_text(json.dumps({"metadata": meta, "rows": [asdict(r) for r in rows],
                                "checks": checks}, indent=2) + "\n")
    written.append(path)

    path = out / "results.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[f.name for f in fields(Row)])
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
    written.append(path)

    path = out / "results.md"
    parts = [header_text(meta), "", markdown_table(rows)]
    if checks:
        parts += ["", "Correctness against the float64 ttt reference backend "
                  "(relative error ||x - ref|| / ||ref||):", "", checks_table(checks)]
    path.write_text("\n".join(parts) + "\n")
    written.append(path)

    path = out / "environment.txt"
    path.write_text(environment_text(meta))
    written.append(path)

    if plot:
        png = plot_results(out / "results.png", rows, meta)
        if png is not None:
            written.append(png)
    return written


def plot_results(path: Path, rows: list[Row], meta: dict) -> Path | None:
    """Grouped bars per shape: fwd+bwd ms (log scale) and speed-up vs the best FLA."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"(no plot: matplotlib cannot be imported: {exc})")
        return None

    shapes = list(dict.fromkeys(r.shape for r in rows))
    providers = list(dict.fromkeys(r.provider for r in rows if r.fwd_ms or r.fwdbwd_ms))
    if not providers:
        print("(no plot: no provider produced a time)")
        return None
    by_key = {(r.shape, r.provider): r for r in rows}
    have_speedup = any(r.speedup_fwdbwd for r in rows)
    panels = [("fwd+bwd ms (median, log scale)", "fwdbwd_ms", True),
              ("fwd ms (median, log scale)", "fwd_ms", True)]
    if have_speedup:
        panels.append(("speed-up vs fastest FLA, fwd+bwd", "speedup_fwdbwd", False))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7.0, 1.6 * len(shapes) + 3), 3.4 *
                                                       len(panels)), squeeze=False)
    width = 0.8 / max(1, len(providers))
    for ax, (title, attr, log) in zip(axes[:, 0], panels):
        for i, provider in enumerate(providers):
            xs, ys = [], []
            for j, shape in enumerate(shapes):
                row = by_key.get((shape, provider))
                value = getattr(row, attr) if row is not None else None
                if value:
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(value)
            ax.bar(xs, ys, width=width, label=provider)
        if log:
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlim(-0.5, len(shapes) - 0.5)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"B,T,H,D=\n{s}" for s in shapes], fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=8, ncol=min(4, len(providers)))
    fig.suptitle(f"chunk_ttt_linear {meta['dtype']}, chunk {meta['chunk_size']} - "
                 f"{meta['device_name']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
