"""A CPU-only proxy for the chain kernels' step latency: what the sm_90 SASS does per chunk.

    python -m tools.step_proxy --backends triton cupy --bd 64 128 --bt 16 32 64

The chain kernels carry the [D, D] state through a sequence one chunk at a time, so the time
of one trip of their chain loop sets the training speed. Without a GPU this compiles each
chain kernel as its backend's launcher would (Triton: ``tools.resources``' inputs in the
default form with ``tuning``'s default options; cupy: the tensor-core instances that
``ttt_cupy.compile.pass_names`` names, through NVRTC), disassembles it (``nvdisasm`` of
Triton's wheel), finds the chain loop and counts what one warp issues per trip:
instructions (NOPs left out), tensor-core instructions (HMMA, HGMMA) and their products in
m16n8k8 units (1024 multiply-adds per warp; HMMA.1688 is 1, HGMMA.64x64x8 8), barriers
(BAR, SYNCS), shared stores (STS) and loads (LDS, LDSM), shuffles, global loads (LDG,
LDGSTS, UTMALDG; not CCTL prefetches) and stores (STG), conversions (F2F, F2FP, I2F, F2I,
I2I, FRND; a bf16 widened by a shift or PRMT is none), spill traffic (LDL, STL), and the
registers and stack per thread (``cuobjdump -res-usage``). Only the chains the default rules
may pick are compiled (``--all``: every one): the fused ones run given enough chains
(``tuning.FUSED``, ``ttt_cupy.placement.FUSED``), Triton's fused backward only at chunk 16,
head dim <= 64, cupy's at head dim <= 64 within an sm_90 block's shared memory.

The chain loop: a loop is a back edge's natural loop (the blocks that reach the branch
back without passing its target; a jump back to a block that does not dominate the branch,
out-of-line code returning, is none). Of the loops holding tensor-core instructions, the
one with the most (the largest on a tie) is taken, then its inner loop while one holds all
of its tensor-core instructions and barriers (an outer loop around the chain has no
products or barriers of its own; a chunk's products are never all inside one inner loop).
Each kernel's line before the table prints the loop taken: its header's address to its
back edge's, and its blocks placed after the back edge.

A count ``a+b``: ``a`` in the blocks every trip runs (they dominate the back edge), ``b``
in the loop's conditional blocks (the checkpoint slot store every G chunks, the lanes'
reduction writes, alternative load paths, per-warp loops, a last chunk's masking), each
block counted once; an inner loop's blocks count its trips where its counter runs from an
immediate to an immediate bound, else once (``*`` on the row; its range is printed; in
the default kernels these are cupy's L1 prefetch loops and per-warp tile loops, while the
per-chunk products are unrolled: no static inner loop is left).

Limits: a static count, not a schedule. It weighs neither latency nor dual issue nor
stalls, nor how often the conditional blocks run; Triton's chains are compiled with the
narrow checkpoint interval (G=16) and the default form (no eta_key, norm_residual). It is a
proxy: whether it tracks the measured step time is for the first GPU run to show (ncu's
instruction counts per region, ``tools/ncu_regions.py``, check the counts themselves).
Numbers come from the Triton and NVRTC installed here, which may differ from the GPU's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

os.environ.pop("TRITON_INTERPRET", None)

CLASSES = {"mma": {"HMMA", "HGMMA", "IMMA"}, "bar": {"BAR", "SYNCS"}, "sts": {"STS"},
           "lds": {"LDS", "LDSM"}, "shfl": {"SHFL"}, "ldg": {"LDG", "LDGSTS", "UTMALDG"},
           "stg": {"STG"}, "cvt": {"F2F", "F2FP", "I2F", "F2I", "I2I", "I2FP", "F2IP", "FRND"},
           "local": {"LDL", "STL"}}
"""Column -> the SASS opcodes (before the first dot) it counts."""

COLUMNS = ("instr", "mma", "m16n8k8", *(c for c in CLASSES if c != "mma"))
HEADER = ("instructions/iter", "mma", "mma as m16n8k8", "bar", "sts", "lds(+ldsm)", "shfl",
          "ldg", "stg", "cvt", "ldl+stl")
TRITON_CHAINS = ("fwd_chain", "fwd_fused", "bwd_chain", "bwd_fused")
CUPY_CHAINS = ("fwd_chain", "fwd_chain_fused", "bwd_chain", "bwd_chain_fused")
SM90_SMEM = 232448
"""Dynamic shared memory an sm_90 block may opt into (cupy's fused backward must fit)."""

_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^([.$][\w$.]+):")
_TARGET = re.compile(r"`\(([.$][\w$.]+)\)")
_PRED = re.compile(r"^@!?U?P[T0-9]\s+")
_PRED_OPERAND = re.compile(r"^!?U?P[0-9]\s*,")


@dataclass
class Insn:
    addr: int
    op: str                 # the opcode with its modifiers, e.g. "BAR.SYNC.DEFER_BLOCKING"
    text: str
    guarded: bool           # an @P guard
    target: str | None      # a branch's label


@dataclass
class Block:
    insns: list[Insn]
    succ: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.insns[0].addr


def parse(sass: str) -> tuple[list[Insn], dict[str, int]]:
    """The instructions of ``nvdisasm -c`` output and {label: index of the next one}."""
    insns, labels = [], {}
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            labels[m.group(1)] = len(insns)
        elif m := _INSN.match(line):
            text = m.group(2)
            guarded = bool(_PRED.match(text))
            body = _PRED.sub("", text)
            op, _, rest = body.partition(" ")
            t = _TARGET.search(rest) if op.startswith(("BRA", "CALL", "BSSY")) else None
            cond = guarded or bool(_PRED_OPERAND.match(rest)) or op.startswith("BRA.DIV")
            insns.append(Insn(int(m.group(1), 16), op, text, cond, t and t.group(1)))
    return insns, labels


def blocks(insns: list[Insn], labels: dict[str, int]) -> list[Block]:
    """Basic blocks with their successors (block indices); a CALL falls through."""
    leaders = {0, *labels.values()}
    for i, ins in enumerate(insns):
        if ins.op.startswith(("BRA", "EXIT", "RET", "BRX", "JMX")):
            leaders.add(i + 1)
    starts = sorted(x for x in leaders if x < len(insns))
    index = {s: j for j, s in enumerate(starts)}
    out = [Block(insns[s:e]) for s, e in zip(starts, [*starts[1:], len(insns)])]
    for j, blk in enumerate(out):
        last = blk.insns[-1]
        if last.op.startswith("BRA") and last.target in labels:
            out[j].succ.append(index[labels[last.target]])
        ends = last.op.startswith(("BRA", "EXIT", "RET", "BRX", "JMX")) and not last.guarded
        if not ends and j + 1 < len(out):
            out[j].succ.append(j + 1)
    return out


def loops(bl: list[Block]) -> dict[int, tuple[set[int], int]]:
    """{header: (natural loop's blocks, the last back edge's source)} of every back edge
    (a branch to a block at or before it that dominates it)."""
    pred: dict[int, list[int]] = {j: [] for j in range(len(bl))}
    for j, b in enumerate(bl):
        for s in b.succ:
            pred[s].append(j)
    found: dict[int, tuple[set[int], int]] = {}
    for j, b in enumerate(bl):
        for h in (s for s in b.succ if s <= j):
            body, work = {h, j}, [j] if j != h else []
            while work:
                for p in pred[work.pop()]:
                    if p not in body:
                        body.add(p)
                        work.append(p)
            if 0 in body and h != 0:   # h does not dominate j: no loop (a jump back)
                continue
            old = found.get(h, (set(), j))[0]
            found[h] = (body | old, j)
    return found


def mma_macs(op: str) -> int:
    """A tensor-core instruction's multiply-adds per warp: HMMA.1688 1024, HMMA.16816 2048,
    HGMMA.64x64x8 (a warpgroup's; a quarter per warp) 8192."""
    if m := re.match(r"HMMA\.(16|8)(8)(\d+)\.", op):
        return int(m.group(1)) * 8 * int(m.group(3))
    if m := re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)\.", op):
        return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) // 4
    return 0


def count(bl: list[Block], ids, cls: str) -> int:
    """Instructions of column ``cls`` in blocks ``ids`` (``m16n8k8``: their products per
    warp in m16n8k8 units, 1024 multiply-adds, :func:`mma_macs`)."""
    insns = [ins for j in ids for ins in bl[j].insns if ins.op != "NOP"]
    if cls == "m16n8k8":
        return sum(mma_macs(ins.op) for ins in insns) // 1024
    ops = CLASSES.get(cls)
    return sum(1 for ins in insns if ops is None or ins.op.split(".")[0] in ops)


def chain_loop(bl: list[Block]) -> tuple[int, set[int], int]:
    """(header, blocks, latch) of the chain loop (module docstring)."""
    lp = loops(bl)
    mma = {h: count(bl, body, "mma") for h, (body, _) in lp.items()}
    if not any(mma.values()):
        raise ValueError("no loop holds tensor-core instructions")
    h = max(lp, key=lambda x: (mma[x], len(lp[x][0])))
    while True:
        body = lp[h][0]
        inner = [x for x in lp if x != h and lp[x][0] < body and mma[x] == mma[h]
                 and count(bl, lp[x][0], "bar") == count(bl, body, "bar")]
        if not inner:
            return h, body, lp[h][1]
        h = max(inner, key=lambda x: len(lp[x][0]))


def dominators(bl: list[Block], body: set[int], head: int) -> dict[int, set[int]]:
    """Dominators within the loop's blocks, entered at ``head``."""
    dom = {j: set(body) for j in body}
    dom[head] = {head}
    preds = {j: [p for p in body if j in bl[p].succ] for j in body}
    changed = True
    while changed:
        changed = False
        for j in sorted(body - {head}):
            new = {j} | set.intersection(*(dom[p] for p in preds[j])) if preds[j] else {j}
            if new != dom[j]:
                dom[j], changed = new, True
    return dom


def trips(bl: list[Block], body: set[int], latch: int) -> int | None:
    """An inner loop's static trip count: its latch compares a register with an immediate,
    the body adds an immediate to it and the block before the loop sets it to one."""
    cmp = next((i for i in reversed(bl[latch].insns) if i.op.startswith("ISETP")), None)
    m = cmp and re.search(r"ISETP\.\w+\.AND P\d, PT, (R\d+), (0x[0-9a-f]+|\d+), PT", cmp.text)
    if not m:
        return None
    reg, bound = m.group(1), int(m.group(2), 0)
    step = init = None
    for ins in (i for j in body for i in bl[j].insns):
        s = re.search(rf"IADD3 {reg}, {reg}, (0x[0-9a-f]+|\d+), RZ", ins.text)
        step = int(s.group(1), 0) if s else step
    before = bl[min(body) - 1].insns if min(body) > 0 else []
    for ins in before:
        s = re.search(rf"(?:MOV|IMAD\.MOV\.U32) {reg}, (?:RZ, RZ, )?(0x[0-9a-f]+|\d+|RZ)",
                      ins.text)
        init = (0 if s.group(1) == "RZ" else int(s.group(1), 0)) if s else init
    if not step or init is None or bound <= init:
        return None
    return -(-(bound - init) // step)


def per_trip(bl: list[Block]) -> dict:
    """The chain loop's range, its counts {column: (every trip, conditional)}, and the inner
    loops with runtime trip counts."""
    head, body, latch = chain_loop(bl)
    dom = dominators(bl, body, head)
    weight = dict.fromkeys(body, 1)
    runtime = []
    for h, (inner, src) in loops(bl).items():
        if h != head and inner < body:
            n = trips(bl, inner, src)
            if n is None:
                runtime.append(f"{bl[h].start:#x}-{bl[src].insns[-1].addr:#x}")
            for j in inner:
                weight[j] *= n or 1
    counts = {}
    for col in COLUMNS:
        every = sum(weight[j] * count(bl, [j], col) for j in dom[latch])
        cond = sum(weight[j] * count(bl, [j], col) for j in body - dom[latch])
        counts[col] = (every, cond)
    end = bl[latch].insns[-1].addr
    after = sum(bl[j].start > end for j in body)
    where = f"{bl[head].start:#x}-{end:#x}" + f" (+{after} blocks after it)" * bool(after)
    return dict(range=where, blocks=len(body), counts=counts, runtime=runtime)


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def analyze(cubin: bytes) -> dict:
    """:func:`per_trip` of a one-kernel cubin, with ``regs`` and ``stack``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    out = per_trip(blocks(*parse(sass)))
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    out["regs"], out["stack"] = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return out


def triton_cubin(kernel: str, dtype: str, BD: int, BT: int) -> bytes:
    from tools.resources import row_kernel

    return row_kernel(kernel, dtype, BD, BT)[0].asm["cubin"]


def cupy_cubin(kernel: str, dtype: str, BD: int, BT: int) -> bytes:
    from ttt_cupy.compile import compile_options, pass_names, source
    from ttt_cupy.diskcache import compile_cubin

    ctype = {"bf16": "__nv_bfloat16", "fp16": "__half"}[dtype]
    pass_ = "fwd" if kernel.startswith("fwd") else "bwd"
    name = pass_names(pass_, ctype, BD, BT, True)[kernel]
    return compile_cubin(source(pass_), [name], "90", compile_options())[0]


def picked(backend: str, kernel: str, BD: int, BT: int) -> bool:
    """Whether the launcher's default rules may choose this chain (fused ones: given enough
    chains; Triton's fused backward only at chunk 16, head dim <= 64)."""
    if backend == "triton":
        from tools.resources import picked as triton_picked

        return triton_picked(kernel, "bf16", BD, BT)
    if kernel == "bwd_chain_fused":
        from ttt_cupy.compile import FUSED_BWD_MAX_D_PAD
        from ttt_cupy.smem import bwd_chain_fused_smem_bytes

        return BD <= FUSED_BWD_MAX_D_PAD and bwd_chain_fused_smem_bytes(BD, BT) <= SM90_SMEM
    return True


def job(task: tuple) -> tuple:
    backend, kernel, dtype, BD, BT = task
    try:
        make = triton_cubin if backend == "triton" else cupy_cubin
        return task, analyze(make(kernel, dtype, BD, BT))
    except Exception as exc:  # noqa: BLE001 - a report row
        return task, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"


def cell(pair: tuple[int, int]) -> str:
    return f"{pair[0]}+{pair[1]}" if pair[1] else str(pair[0])


def row(task: tuple, r) -> str:
    backend, kernel, dtype, BD, BT = task
    kernel += "" if picked(backend, kernel, BD, BT) else " (not picked)"
    head = f"| {backend} | {kernel} | {dtype} | {BD} | {BT} |"
    if isinstance(r, str):
        return f"{head} FAILED {r} |"
    cells = [cell(r["counts"][c]) for c in COLUMNS]
    cells[0] += "*" if r["runtime"] else ""
    return f"{head} {' | '.join(cells)} | {r['regs']} ({r['stack']}) |"


def versions(backends) -> str:
    import triton

    line = f"sm_90 SASS; triton {triton.__version__} (nvdisasm, cuobjdump, ptxas)"
    if "cupy" in backends:
        from ttt_cupy.diskcache import nvrtc_version

        line += f"; NVRTC {nvrtc_version()}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["triton", "cupy"],
                        choices=["triton", "cupy"])
    parser.add_argument("--bd", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--bt", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    parser.add_argument("--all", action="store_true",
                        help="also the chains the default rules never pick")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    tasks = [(be, k, dt, BD, BT) for be in args.backends for dt in args.dtypes
             for k in (TRITON_CHAINS if be == "triton" else CUPY_CHAINS)
             for BD in args.bd for BT in args.bt if args.all or picked(be, k, BD, BT)]
    print(versions(args.backends))
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(job, tasks))
    for task, r in results:
        if not isinstance(r, str):
            extra = f"; inner loops counted once: {', '.join(r['runtime'])}" * bool(r["runtime"])
            print(f"{' '.join(map(str, task))}: chain loop {r['range']} "
                  f"({r['blocks']} blocks){extra}")
    cols = ("backend", "kernel", "dtype", "D", "chunk", *HEADER, "regs (stack B)")
    print(f"\n| {' | '.join(cols)} |\n|{'---|' * len(cols)}")
    for task, r in results:
        print(row(task, r))


if __name__ == "__main__":
    main()
