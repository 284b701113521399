"""Where a kernel's time goes between its barriers, from Nsight Compute's source page.

    ncu --clock-control none --profile-from-start off --set full --import-source no \\
        -k regex:bwd_grads -o report \\
        python -m tools.profile_kernels --backend cupy --shapes 32,2048,16,64 --ncu
    ncu -i report.ncu-rep -k regex:bwd_grads --page source --csv --print-source sass > sass.csv
    python -m tools.ncu_regions sass.csv --steps 65536

Cuts the kernel's SASS at its block barriers (``BAR.SYNC`` / ``BAR.RED``) and prints, per
region that holds at least 1% of the warp stall samples or of the shared-memory wavefronts:
the region's share of the samples, its shared-memory wavefronts per step (the excess, i.e.
bank conflicts, in brackets), its executed instructions per step (all, ``HMMA``, ``LDS``,
``STS``, ``LDG``) and its four largest stall reasons (% of all samples). ``--steps``
divides the counts: the launch's chunk steps (bwd_grads at 32,2048,16,64: 32 * 16 * 128 =
65,536) or blocks of rows (bwd_local there: 32,768 blocks of 32 rows); 1 gives totals.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass, field

STALLS = ("stall_barrier", "stall_short_sb", "stall_long_sb", "stall_mio", "stall_wait",
          "stall_math", "stall_not_selected", "stall_selected", "stall_lg",
          "stall_branch_resolving", "stall_dispatch")
OPCODES = ("HMMA", "LDS", "STS", "LDG")


@dataclass
class Region:
    first: int
    last: int = 0
    executed: float = 0.0
    samples: float = 0.0
    wavefronts: float = 0.0
    excess: float = 0.0
    ops: dict[str, float] = field(default_factory=dict)
    stalls: dict[str, float] = field(default_factory=dict)


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def regions(path: str) -> list[Region]:
    """The kernel's SASS in the ``--page source --csv`` export at ``path``, cut at barriers."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    col = {name: i for i, name in enumerate(rows[header])}
    body = rows[header + 1:]
    out, cur = [], Region(0)
    for n, r in enumerate(body):
        source = r[col["Source"]].split()
        opcode = ""
        if source:
            opcode = (source[1] if source[0].startswith("@") and len(source) > 1
                      else source[0]).split(".")[0]
        executed = _number(r[col["Instructions Executed"]])
        cur.executed += executed
        if opcode in OPCODES:
            cur.ops[opcode] = cur.ops.get(opcode, 0.0) + executed
        cur.samples += _number(r[col["Warp Stall Sampling (All Samples)"]])
        cur.wavefronts += _number(r[col["L1 Wavefronts Shared"]])
        cur.excess += _number(r[col["L1 Wavefronts Shared Excessive"]])
        for s in STALLS:
            if s in col:
                cur.stalls[s] = cur.stalls.get(s, 0.0) + _number(r[col[s]])
        if opcode == "BAR" or n == len(body) - 1:
            cur.last = n
            out.append(cur)
            cur = Region(n + 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--steps", type=float, default=1.0,
                        help="divide counts by this many steps (default 1: totals)")
    args = parser.parse_args()
    regs = regions(args.csv)
    samples = sum(g.samples for g in regs) or 1.0
    wavefronts = sum(g.wavefronts for g in regs) or 1.0
    per = args.steps
    print(f"{samples:.0f} warp samples; {wavefronts:.4g} shared wavefronts "
          f"({wavefronts / per:.0f} per step)")
    for g in regs:
        if g.samples < 0.01 * samples and g.wavefronts < 0.01 * wavefronts:
            continue
        ops = " ".join(f"{op} {g.ops.get(op, 0.0) / per:.0f}" for op in OPCODES)
        top = sorted(g.stalls.items(), key=lambda kv: -kv[1])[:4]
        stalls = " ".join(f"{name[6:]} {100 * v / samples:.1f}" for name, v in top)
        print(f"SASS {g.first:5d}-{g.last:5d}: {100 * g.samples / samples:5.1f}% of samples, "
              f"{g.wavefronts / per:6.0f} wavefronts ({g.excess / per:5.0f} excess), "
              f"{g.executed / per:6.0f} instructions ({ops}) | {stalls}")


if __name__ == "__main__":
    main()
