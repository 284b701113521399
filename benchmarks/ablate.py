"""Where a cupy kernel's time goes, by taking parts out: an ablation run.

    python benchmarks/ablate.py [--shapes 1,32768,16,64 ...] [--variants NAME ...] [--list]

Each variant rewrites the CUDA source of one pass (``ttt_cupy.compile.source``) with exact
text replacements, e.g. the forward chain without its xh / r stores, compiles it with NVRTC
and times the forward and the forward+backward (``triton.testing.do_bench`` medians, same
inputs as ``run.py``), next to the unchanged source in the same process. The numbers of a
variant are wrong by design; its time is what the removed part costs on the chain (or,
when removing it speeds nothing up, that the part is hidden). The 7th session's run of this
kind found that the chains' next-chunk loads, issued a whole step early, cost 37% of the
forward chain's step (docs/benchmarks.md).

A variant whose text is not in the source (the kernels moved on) is reported and skipped:
edit VARIANTS to follow the kernels. Needs a CUDA device, cupy and ttt-cupy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import make_inputs  # noqa: E402

import ttt  # noqa: E402

# the g row pass of the group kernels' tensor-core instances (fwd_out, bwd_local)
GROUP_G_ROWS = ("inner_grad_rows_saved<D_PAD, R, NW>(s_g, s_k, v, xbuf, rbuf, b_w, b_b, "
                "p_base, p_ebase,\n" + " " * 44 + "row0, row_stride, L, H, D);")

# name -> (pass, [(old text, new text), ...]); every old text must occur in the pass's source
# (all occurrences are replaced).
VARIANTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "fwd_chain:no-xh-r-stores": ("fwd", [
        ("if (save && t < L) {  // the saved", "if (false) {  // the saved"),
    ]),
    "fwd_chain:no-next-loads": ("fwd", [
        ("nk.load(k + o_next, rs, Ln, D, vec);", ""),
        ("nv.load(v + o_next, rs, Ln, D, vec);", ""),
        ("nk.store(s_k + (buf ^ 1) * Tr::kTile, 1.f);", ""),
        ("nv.store(s_v + (buf ^ 1) * Tr::kTile, 1.f);", ""),
    ]),
    "fwd_chain:no-state-update": ("fwd", [
        ("state_update_frag<D_PAD, BT, kExact>(W, y, -e_l, sk);", ""),
    ]),
    "fwd_chain:no-y-sums": ("fwd", [
        ("frag_row_sums<NW, BT, 2>(sums, s_red + 2 * NW * BT);", ""),
    ]),
    "fwd_out:no-tile-loads": ("fwd", [
        ("load_tile<D_PAD, R, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);", ""),
        ("load_tile<D_PAD, R, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);", ""),
    ]),
    "fwd_out:no-g-row-pass": ("fwd", [
        (GROUP_G_ROWS, ""),
    ]),
    "bwd_local:no-tile-loads": ("bwd", [
        ("load_tile<D_PAD, R, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);", ""),
        ("load_tile<D_PAD, R, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);", ""),
        ("load_tile<D_PAD, R, NT>(s_do, dout, p_base, row0, L, row_stride, D, 1.f);", ""),
    ]),
    "bwd_local:no-g-row-pass": ("bwd", [
        (GROUP_G_ROWS, ""),
    ]),
    "bwd_grads:no-tile-loads": ("bwd", [
        ("ttt::load_tile<DA, BT, NT>(s_q, q, p_base + a0, row0, L, row_stride, D - a0, scale);",
         ""),
        ("ttt::load_tile<DA, BT, NT>(s_k, k, p_base + a0, row0, L, row_stride, D - a0, 1.f);",
         ""),
        ("ttt::load_tile<D_PAD, BT, NT>(s_dop, dopbuf, p_base, row0, L, row_stride, D, 1.f);",
         ""),
    ]),
    # the staged instance (Traits::kBwdChainStage, chunk 16): the 7th session's ablation of the
    # register loads found 1.57 ms (rows) and 0.94 ms (q, k) of a 6.6 ms chain; staged since
    "bwd_chain:no-row-stage": ("bwd", [
        ("if (kStage && i_c > 0) stage_rows(row0p, BT);", ""),
    ]),
    "bwd_chain:no-row-reads": ("bwd", [
        ("frag_rows_from_smem<BT, RowsF::kLd>(xh, s_xh);", "zero_frag<BT>(xh);"),
        ("frag_rows_from_smem<BT, RowsT::kLd>(vv, s_v);", "zero_frag<BT>(vv);"),
        ("frag_rows_from_smem<BT, RowsF::kLd>(dop, s_dop);", "zero_frag<BT>(dop);"),
        ("frag_rows_from_smem<BT, RowsF::kLd>(dg, s_dg);", "zero_frag<BT>(dg);"),
    ]),
    "bwd_chain:no-prev-qk": ("bwd", [
        ("RowsT::copy(s_pq, q + o_prev, rs, BT, D, vec);", ""),
        ("RowsT::copy(s_pk, k + o_prev, rs, BT, D, vec);", ""),
        ("RowsT::to_tile(s_q + (buf ^ 1) * Tr::kTile, s_pq, 1.f);", ""),
        ("RowsT::to_tile(s_k + (buf ^ 1) * Tr::kTile, s_pk, 1.f);", ""),
    ]),
    # every prefetch_spans call of a pass (the chains' and the group kernels' hints)
    "fwd:no-prefetch-spans": ("fwd", [
        ("prefetch_spans<NT, kLpr>(spans);", ""),
    ]),
    "bwd:no-prefetch-spans": ("bwd", [
        ("prefetch_spans<NT, kLpr>(spans);", ""),
    ]),
    "bwd_chain:no-dg-store": ("bwd", [
        ("if (ok) dgbuf[o_rows + t * rs + n0 + 8 * h] = dg[i][c];", ""),
    ]),
    "bwd_chain:no-round-2": ("bwd", [
        ("frag_row_sums<NW, BT, 4>(s2, s_red + 4 * NW * BT);", ""),
    ]),
    "bwd_chain:no-qdop-update": ("bwd", [
        ("state_update_frag<D_PAD, BT, kExact>(dW, dop, scale, sqt);", ""),
    ]),
}

# helpers the replacements may call, added after the common header
HELPERS = """
namespace ttt {
template <int BT>
__device__ __forceinline__ void zero_frag(float (&x)[BT / 8][4]) {
#pragma unroll
    for (int i = 0; i < BT / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) x[i][c] = 0.f;
}
}  // namespace ttt
"""


def patched_source(original, pass_name: str, edits: list[tuple[str, str]]):
    """A replacement for compile.source applying ``edits`` to ``pass_name``'s source; raises
    KeyError when an old text is missing."""
    base = original(pass_name)
    text = base
    for old, new in edits:
        if old not in text:
            raise KeyError(old)
        text = text.replace(old, new)
    marker = "namespace ttt {"
    at = text.index(marker)
    text = text[:at] + HELPERS + text[at:]

    def source(p: str) -> str:
        return text if p == pass_name else original(p)

    return source


def time_variant(shape, dev) -> tuple[float, float]:
    import triton.testing as tt

    xs = [x.requires_grad_() for x in make_inputs(shape, torch.bfloat16, dev, seed=0)]
    do = torch.randn_like(xs[0])

    def fwd():
        return ttt.chunk_ttt_linear(*xs, chunk_size=16, backend="cupy")[0]

    def fwd_bwd():
        torch.autograd.grad(fwd(), xs, do)

    fwd_bwd()
    torch.cuda.synchronize()
    return (tt.do_bench(fwd, warmup=5, rep=40), tt.do_bench(fwd_bwd, warmup=5, rep=40))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1,32768,16,64"])
    parser.add_argument("--variants", nargs="+", default=None,
                        help="names from VARIANTS (default: all)")
    parser.add_argument("--list", action="store_true", help="list the variants and exit")
    args = parser.parse_args()
    if args.list:
        for name, (pass_name, edits) in VARIANTS.items():
            print(f"{name} ({pass_name} pass, {len(edits)} edits)")
        return
    from ttt_cupy import compile as cc

    names = args.variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; --list shows them")
    if not torch.cuda.is_available():
        print("ablate.py needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, bf16, chunk 16")
    original = cc.source
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    print("| shape | variant | fwd ms | fwd+bwd ms | fwd saved | fwd+bwd saved |")
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        base = None
        for name in ["base", *names]:
            if name == "base":
                cc.source = original
            else:
                pass_name, edits = VARIANTS[name]
                try:
                    cc.source = patched_source(original, pass_name, edits)
                except KeyError as err:
                    print(f"| {shape} | {name} | skipped: text not in the source: "
                          f"{str(err)[:60]} | | | |")
                    continue
            cc._module.cache_clear()
            try:
                f, fb = time_variant(shape, dev)
            except Exception as exc:  # noqa: BLE001 - a report line
                print(f"| {shape} | {name} | failed: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:80]} | | | |")
                continue
            if base is None:
                base = (f, fb)
            print(f"| {shape} | {name} | {f:.3f} | {fb:.3f} | {base[0] - f:+.3f} | "
                  f"{base[1] - fb:+.3f} |", flush=True)
    cc.source = original
    cc._module.cache_clear()


if __name__ == "__main__":
    main()
