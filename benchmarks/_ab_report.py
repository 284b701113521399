"""The report of ``compare.py``: header, correctness table, timing table, compare.md/json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SIDES = ("base", "head")


def _ms(summary: dict | None) -> str:
    return "-" if summary is None else f"{summary['median']:.4g}"


def _spread(summary: dict | None) -> str:
    return "-" if summary is None else f"{summary['min']:.4g}-{summary['max']:.4g}"


def _worst(check: dict) -> str:
    """The error nearest its bound: 'name error / bound', or '-'."""
    errors, bounds = check.get("errors", {}), check.get("bounds", {})
    if not errors:
        return "-"
    name = max(errors, key=lambda n: errors[n] / bounds[n])
    return f"{name} {errors[name]:.1e} / {bounds[name]:.0e}"


def _cross_text(cross: dict) -> str:
    if cross.get("error"):
        return f"error: {cross['error']}"
    if cross.get("failed"):
        return "FAIL: " + ", ".join(cross["failed"])
    if cross.get("note"):
        return f"not compared: {cross['note']}"
    return f"ok ({_worst(cross)})"


def header_text(meta: dict) -> str:
    lines = [f"# A/B: base -> head, {meta['device_name']}", ""]
    lines.append(f"- {meta['date']}" + (f", driver {meta['driver']}" if meta["driver"] else ""))
    for name in SIDES:
        side = meta["sides"][name]
        versions = ", ".join(f"{k} {v}" for k, v in side["versions"].items())
        lines.append(f"- {name}: {side['label']}; ttt from {side['ttt_file']}; {versions}")
    lines.append(f"- dtype {meta['dtype']}, chunk size {meta['chunk_size']}, seed "
                 f"{meta['seed']}, {meta['rounds']} rounds taking turns; {meta['timing']}")
    lines.append(f"- exit status {meta['exit_status']}")
    return "\n".join(lines)


def checks_table(meta: dict) -> str:
    lines = ["| side | backend | shape | error nearest its bound | result |",
             "|---|---|---|---|---|"]
    for check in meta["oracle_checks"]:
        worst_text = _worst(check)
        if check.get("error"):
            result = f"error: {check['error']}"
        elif check["failed"]:
            result = "FAIL: " + ", ".join(check["failed"])
        else:
            result = "ok" + (f" ({check['note']})" if check.get("note") else "")
        lines.append(f"| {check['side']} | {check['backend']} | {check.get('shape', '-')} "
                     f"| {worst_text} | {result} |")
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| backend | B,T,H,D | pass | base ms | base min-max | head ms | head min-max "
             "| head/base | spreads overlap | head vs base outputs | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        overlap = {None: "-", True: "yes (noise)", False: "no"}[row["overlap"]]
        lines.append(f"| {row['backend']} | {row['shape']} | {row['pass']} | "
                     f"{_ms(row['base'])} | {_spread(row['base'])} | {_ms(row['head'])} | "
                     f"{_spread(row['head'])} | {ratio} | {overlap} | "
                     f"{_cross_text(row['cross_check'])} | {row['status']} |")
    return "\n".join(lines)


def report_text(meta: dict, rows: list[dict]) -> str:
    return (f"{header_text(meta)}\n\nEach side against its reference backend in float64 "
            f"(suite tolerances):\n\n{checks_table(meta)}\n\nTimes (ms; per side the median and "
            f"the min-max over the rounds):\n\n{markdown_table(rows)}\n")


def write_outputs(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(report_text(meta, rows))
    (out / "compare.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1)
                                      + "\n")
    print(f"wrote {out / 'compare.md'} and {out / 'compare.json'}", file=sys.stderr)
