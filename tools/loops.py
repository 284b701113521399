"""Every innermost loop of a Triton kernel's sm_90 SASS, without a GPU: what one warp issues
per trip and which source functions the loop's instructions come from.

    python -m tools.loops --kernels mlp_bwd --bd 64 --bt 16 --dtypes bf16
    python -m tools.loops --kernels fwd_chain bwd_chain mlp_fwd --bd 64 128 --bt 16

The kernels are ``tools.resources``' rows (``KERNELS`` and ``MLP_KERNELS``), compiled as
the launchers would. Where ``tools.step_proxy`` follows the one chain loop of the TTT-linear
chains, this lists each loop that holds no other (the TTT-MLP kernels walk the hidden
blocks in several such loops per chunk). Each is printed with its instruction count,
tensor-core instructions, shared and local memory traffic, and its source: the kernel
files' functions its instructions were generated from (``nvdisasm -gi`` line info), those
with the most instructions first. Local memory (LDL, STL) inside a loop is the spill
traffic that costs the most. For example, Triton gives a loop's chained tile products the
warps of its last product. In the TTT-MLP backward, a square [16, 16] product last put
every warp on the same 16 rows, and that loop issued 1,986 instructions with 121 LDL and
103 STL per hidden block. With that product taken first, it issued 481 with 40 and 0.
Static counts, as ``tools.step_proxy``'s: no latency, no stalls.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import subprocess
import tempfile

from tools.step_proxy import _tool, blocks, count, loops, parse

os.environ.pop("TRITON_INTERPRET", None)

COUNTED = ("instr", "mma", "lds", "sts", "bar", "local")
_LINE = re.compile(r'\s*//## File "(.*?)", line (\d+)')
_ADDR = re.compile(r"\s*/\*([0-9a-f]+)\*/")


def sass_with_lines(cubin: bytes) -> tuple[str, dict[int, tuple[str, int]]]:
    """``nvdisasm -gi`` text (its line comments are no instructions to :func:`parse`) and
    {instruction address: (source file, line)}."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", "-gi", f.name], capture_output=True,
                              text=True, check=True).stdout
    where, current = {}, None
    for line in sass.splitlines():
        if m := _LINE.match(line):
            current = (m.group(1), int(m.group(2)))
        elif (m := _ADDR.match(line)) and current:
            where[int(m.group(1), 16)] = current
    return sass, where


def functions(path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of each top-level function of a source file."""
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError):
        return []
    return [(n.lineno, n.end_lineno, n.name) for n in tree.body
            if isinstance(n, ast.FunctionDef)]


def source_of(insns, where: dict, defs: dict) -> str:
    """The functions ``insns`` come from, those with the most instructions first."""
    names = collections.Counter()
    for ins in insns:
        if ins.addr in where:
            path, line = where[ins.addr]
            if path not in defs:
                defs[path] = functions(path)
            names.update(n for lo, hi, n in defs[path] if lo <= line <= hi)
    return ", ".join(n for n, _ in names.most_common(6))


def report(kernel: str, dtype: str, BD: int, BT: int) -> list[str]:
    from tools.resources import row_kernel  # (imports the kernels: after the pop above)

    k, options = row_kernel(kernel, dtype, BD, BT)
    sass, where = sass_with_lines(k.asm["cubin"])
    bl = blocks(*parse(sass))
    found, defs = loops(bl), {}
    out = [f"{kernel} {dtype} BD={BD} BT={BT} warps={options['num_warps']}: "
           f"shared {k.metadata.shared} B"]
    for head, (body, _) in sorted(found.items(), key=lambda x: bl[x[0]].start):
        if any(h != head and found[h][0] < body for h in found):
            continue                                   # holds another loop
        insns = [i for j in body for i in bl[j].insns]
        if len(insns) < 8:
            continue                                   # a spin, not a walk
        counts = " ".join(f"{c} {count(bl, body, c)}" for c in COUNTED)
        out.append(f"  loop {bl[head].start:#07x}: {counts}  [{source_of(insns, where, defs)}]")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", default=["mlp_bwd"],
                        help="tools.resources rows: fwd_chain, bwd_chain, mlp_fwd, mlp_bwd, ...")
    parser.add_argument("--bd", type=int, nargs="+", default=[64])
    parser.add_argument("--bt", type=int, nargs="+", default=[16])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp32"])
    args = parser.parse_args()
    for kernel in args.kernels:
        for dtype in args.dtypes:
            for BD in args.bd:
                for BT in args.bt:
                    print("\n".join(report(kernel, dtype, BD, BT)), flush=True)


if __name__ == "__main__":
    main()
