"""The compiled code of every kernel in its default form (no eta_key, ``norm_residual``, every
gradient), for sm_90 without a GPU: dump it, or compare two dumps.

    python -m tools.default_ir dump DIR
    python -m tools.default_ir compare DIR_A DIR_B

``dump`` writes TTIR, TTGIR, LLVM IR and PTX of each configuration of ``resources.py``'s
kernel table (dense and packed, bf16 and fp32, head dim 64 at chunk 16 and 128 at chunk 64);
``compare`` tells which differ once source locations, SSA value names and debug sections are
left out. To compare with another revision's kernels, dump with its sources first on the
path: ``git archive REV packages/ttt-triton/src | tar -x -C /tmp/rev`` then
``PYTHONPATH=/tmp/rev/packages/ttt-triton/src python -m tools.default_ir dump A``.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

STAGES = ("ttir", "ttgir", "llir", "ptx")
SHAPES = ((64, 16), (128, 64))          # (padded head dim, chunk)


def dump(out: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    from tools.resources import KERNELS, compile_inputs

    os.makedirs(out, exist_ok=True)
    target = GPUTarget("cuda", 90, 32)
    for dtype in ("bf16", "fp32"):
        for BD, BT in SHAPES:
            for varlen in (False, True):
                for name, fn, kind, rows, extra in KERNELS:
                    src, options, _ = compile_inputs(name, fn, kind, rows, extra, dtype, BD,
                                                     BT, varlen=varlen)
                    kernel = triton.compile(src, target=target, options=options)
                    label = f"{name}_{dtype}_bd{BD}_bt{BT}{'_varlen' if varlen else ''}"
                    for stage in STAGES:
                        with open(os.path.join(out, f"{label}.{stage}"), "w") as f:
                            f.write(kernel.asm[stage])
                    print(label, flush=True)


def normalized(text: str, stage: str) -> str:
    """``text`` without source locations, debug sections and SSA value names."""
    if stage == "ptx":
        lines = text.splitlines()
        end = next((i for i, line in enumerate(lines) if line.startswith("$L__func_end")),
                   len(lines))
        return "\n".join(line for line in lines[:end]
                         if not line.strip().startswith((".loc", ".file", "//", "$L__")))
    if stage == "llir":
        text = re.sub(r", !dbg ![0-9]+", "", text)
        text = "\n".join(line for line in text.splitlines() if not line.startswith("!"))
    else:
        text = re.sub(r" loc\((?:[^()]|\([^()]*\))*\)", "", text)
        text = "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))
    names: dict[str, str] = {}
    return re.sub(r"%[A-Za-z_][\w.]*|%\d+",
                  lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)


def compare(a: str, b: str) -> int:
    files = sorted(os.listdir(a))
    differ = []
    for name in files:
        stage = name.rsplit(".", 1)[1]
        texts = []
        for folder in (a, b):
            with open(os.path.join(folder, name)) as f:
                texts.append(normalized(f.read(), stage))
        if texts[0] != texts[1]:
            differ.append(name)
    for name in differ:
        print("differs:", name)
    print(f"{len(files) - len(differ)} of {len(files)} identical")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
