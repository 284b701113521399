"""No GPU needed: every launch of the cupy launcher against its kernel's argument struct.

Each kernel takes one struct (``csrc/params.cuh``), which the launcher packs with
:mod:`ttt_cupy.params`; a field of the wrong width or offset is not an error CUDA reports, it
is garbage. :func:`test_struct_layouts_match_the_cuda_headers` compares every field's offset
and width and each struct's size with the C++ ones (g++ on the header; the same header goes
through NVRTC in ``test_nvrtc_compile.py``). Then the whole forward and backward run on CPU
tensors through the launcher's device seam (``conftest.RecordingDevice``); each launch is
recorded and its struct checked: for the fused and unfused forward and backward, one launch
and segmented passes, dense and varlen, with and without initial states, tensor-core and SIMT
instances. It also checks which instances each pass launches and how often, the
shared-memory size the kernel is told against the launch's, a block of whole warps, and that
every pointer is null or inside a tensor the launcher handed to the device.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from ttt import make_problem
from ttt_cupy import compile as cc
from ttt_cupy import launcher
from ttt_cupy.config import Schedule, config
from ttt_cupy.params import STRUCTS
from ttt_cupy.placement import segment_plan
from ttt_cupy.smem import grads_split

CPP_TYPES = {"FwdParams": "ttt::FwdParams<float>", "BwdParams": "ttt::BwdParams<float>",
             "DecodeParams": "ttt::DecodeParams<float, float>"}


def layout_program() -> str:
    """A C++ program printing ``struct field offset width`` for every field of
    :data:`ttt_cupy.params.STRUCTS` and ``struct - size 0`` for each struct (a field missing
    from the C++ struct fails its compile)."""
    lines = ['#include <cstddef>', '#include <cstdio>', '#include "params.cuh"',
             *[f"using {name} = {cpp};" for name, cpp in CPP_TYPES.items()], 'int main() {']
    for name, cls in STRUCTS.items():
        cpp = name   # (an alias: offsetof takes no commas)
        lines.append(f'  std::printf("{name} - %zu 0\\n", sizeof({cpp}));')
        for field, _ in cls._fields_:
            lines.append(f'  std::printf("{name} {field} %zu %zu\\n", offsetof({cpp}, {field}), '
                         f'sizeof((({cpp}*)nullptr)->{field}));')
    return "\n".join([*lines, "}"]) + "\n"


def test_struct_layouts_match_the_cuda_headers(tmp_path):
    """Every field of the Python structs at the C++ struct's offset and of its width, and
    each struct of the C++ size (g++ on csrc/params.cuh)."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found")
    src = tmp_path / "layout.cpp"
    src.write_text(layout_program())
    exe = tmp_path / "layout"
    build = subprocess.run([cxx, "-std=c++17", f"-I{cc.CSRC}", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    got = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        struct, field, offset, width = line.split()
        got[struct, field] = (int(offset), int(width))
    for name, cls in STRUCTS.items():
        assert got[name, "-"][0] == ctypes.sizeof(cls), f"{name}: sizeof"
        for field, kind in cls._fields_:
            want = (getattr(cls, field).offset, ctypes.sizeof(kind))
            assert got[name, field] == want, f"{name}.{field}: C++ {got[name, field]}, {want}"


def _layout_kernel() -> tuple[str, list[int]]:
    """A kernel writing every struct's size and each field's offset and width into ``out``
    (pointer differences, which NVRTC folds to constants: ``offsetof`` and
    ``__builtin_offsetof`` are not in every NVRTC), and the values ctypes gives, in order."""
    lines, want = [f"using {name} = {cpp};" for name, cpp in CPP_TYPES.items()], []
    lines.append('extern "C" __global__ void layout(unsigned long long* out) {')
    for name, cls in STRUCTS.items():
        lines.append(f"  {{ {name} s{{}}; const char* base = (const char*)&s;")
        lines.append(f"    out[{len(want)}] = sizeof({name});")
        want.append(ctypes.sizeof(cls))
        for field, kind in cls._fields_:
            lines.append(f"    out[{len(want)}] = (const char*)&s.{field} - base; "
                         f"out[{len(want) + 1}] = sizeof(s.{field});")
            want += [getattr(cls, field).offset, ctypes.sizeof(kind)]
        lines.append("  }")
    return "\n".join([*lines, "}"]) + "\n", want


def test_struct_layouts_match_through_nvrtc():
    """The same layouts in device code: NVRTC (compute_90 PTX) folds each offset, width and
    size into a constant stored by a kernel; the stores' constants match ctypes'."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python's NVRTC")
    from ttt_cupy import diskcache as nvrtc

    kernel, want = _layout_kernel()
    code = (cc.CSRC / "params.cuh").read_text() + kernel
    with nvrtc.program(code, [], list(cc.NVRTC_OPTIONS), "compute_90") as (nv, prog, _):
        ptx = nvrtc.output(nv, prog, "PTX").decode(errors="replace")
    constants = dict(re.findall(r"mov\.[ub]64\s+(%rd\d+),\s*(\d+);", ptx))
    got = {}
    for offset, value in re.findall(r"st\.global\.[ub]64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%?\w+);",
                                    ptx):
        assert value in constants or value.isdigit(), f"store of a non-constant {value}"
        got[int(offset or 0) // 8] = int(constants.get(value, value))
    assert [got.get(i) for i in range(len(want))] == want


def test_struct_layout_check_fails_on_a_difference(tmp_path, monkeypatch):
    """The layout check sees a field the C++ struct lacks (its program does not compile)."""
    import ttt_cupy.params as params

    class Broken(params.Params):
        _fields_ = [*params.DecodeParams._fields_, ("missing", ctypes.c_int32)]

    monkeypatch.setitem(params.STRUCTS, "DecodeParams", Broken)
    monkeypatch.setitem(STRUCTS, "DecodeParams", Broken)
    with pytest.raises(AssertionError):
        test_struct_layouts_match_the_cuda_headers(tmp_path)


def _problem(dtype, D, lens, init, H=2, chunk_size=16):
    """A problem on CPU tensors, random values: one sequence of each length in ``lens``
    (varlen when more than one)."""
    gen = torch.Generator().manual_seed(0)
    N, T = len(lens), sum(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    cu = (torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64) if N > 1 else None)
    q, k, v = (randn(1, T, H, D).to(dtype) for _ in range(3))
    h0, hb0 = (randn(N, H, D, D), randn(N, H, 1, D)) if init else (None, None)
    return make_problem(q, k, v, randn(H, D), randn(H, D), 0.1 * randn(1, T, H, 1).abs(),
                        chunk_size=chunk_size, initial_state=h0, initial_state_bias=hb0,
                        output_final_state=True, cu_seqlens=cu)


def _inside(address: int, tensors) -> bool:
    for t in tensors:
        start = t.untyped_storage().data_ptr()
        if start <= address < start + t.untyped_storage().nbytes():
            return True
    return False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [64, 100], ids=["D64", "D100"])
@pytest.mark.parametrize("lens", [(800,), (300, 900, 5)], ids=["dense", "varlen"])
@pytest.mark.parametrize("init", [False, True], ids=["no-h0", "h0"])
@pytest.mark.parametrize("fuse", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("segments", ["1", "3", "overlap"],
                         ids=["one-launch", "3-segments", "overlapped"])
def test_launch_arguments_match_kernel_signatures(recording, dtype, D, lens, init, fuse,
                                                  segments):
    overlap = segments == "overlap"
    schedule = Schedule(fuse_forward=fuse == "1", fuse_backward=fuse == "1", overlap=overlap,
                        segments=None if overlap else int(segments))
    launches = recording.launches
    p = _problem(dtype, D, lens, init)
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, save_for_backward=True, schedule=schedule,
                                                device=recording)
    n_fwd = len(launches)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen).to(dtype)
    dht, dhbt = torch.randn(ht.shape, generator=gen), torch.randn(hbt.shape, generator=gen)
    launcher.ttt_linear_bwd(p, saved, do, dht, dhbt, schedule=schedule, device=recording)
    launches_per_kernel = len(segment_plan(p, saved.groups.groups_max, schedule=schedule))
    assert launches_per_kernel == (1 if overlap else int(segments))  # (3 groups or more)

    # the instances each pass launched (pass_names: tensor-core ones for half inputs), fused
    # where asked (the backward: tensor cores, D_PAD <= 64 only), once per segment (the fused
    # forward: one launch; the overlapped one: fwd_chain, fwd_out and fwd_out's cleanup)
    ctype, dp = cc.CTYPES["bfloat16" if dtype == torch.bfloat16 else "float32"], cc.d_pad(D)
    mma = dtype != torch.float32 and config().mma   # (TTT_CUPY_MMA=0: the SIMT ones)
    fwd_names = cc.pass_names("fwd", ctype, dp, 16, mma)
    bwd_names = cc.pass_names("bwd", ctype, dp, 16, mma)
    fwd = [n for n, *_ in launches[:n_fwd]]
    bwd = [n for n, *_ in launches[n_fwd:]]
    want = ([fwd_names[cc.FUSED_NAME]] if fuse == "1" else
            [fwd_names["fwd_chain"], *[fwd_names["fwd_out"]] * (1 + overlap)]
            * launches_per_kernel)
    assert sorted(fwd) == sorted(want), fwd
    chain = cc.FUSED_BWD_NAME if fuse == "1" and cc.FUSED_BWD_NAME in bwd_names else "bwd_chain"
    want = [bwd_names[n] for n in ("bwd_local", chain, "bwd_grads")
            if n != "bwd_grads" or chain == "bwd_chain"] * launches_per_kernel
    if overlap and chain == "bwd_chain":  # and bwd_grads' cleanup
        want.append(bwd_names["bwd_grads"])
    assert sorted(bwd) == sorted(want), bwd
    # overlapped passes (the group kernel not fused away): chain, group kernel (kOverlap),
    # cleanup (kCleanup) on one sync buffer; the group kernel's stream waits until every chain
    # block of the pass has started
    passes = []
    if overlap and fuse == "0":
        passes.append((launches[:3], 1))
    if overlap and chain == "bwd_chain":
        passes.append((launches[n_fwd + 1:n_fwd + 4], grads_split(dp, 16)))
    syncs = []
    for three, per_item in passes:
        (_, _, _, _, c_args), (_, o_grid, _, _, o_args), (_, k_grid, _, _, k_args) = three
        sync = c_args.sync
        assert sync != 0 and o_args.sync == sync == k_args.sync, "sync buffers"
        assert (o_args.mode, k_args.mode) == (1, 2), "the group kernel's modes"
        tickets = p.N * p.H * saved.groups.groups_max * per_item
        assert o_args.n_chains == k_args.n_chains == p.N * p.H
        assert o_grid == k_grid == tickets
        syncs.append(sync)
    assert recording.waits == [(a, p.N * p.H) for a in syncs], recording.waits

    tensors = recording.tensors    # (every tensor whose address the launcher took)
    for name, grid, block, smem, params in launches:
        _check_params(name, params, smem, tensors)
        assert grid > 0 and block % 32 == 0 and 0 < block <= 1024, (name, grid, block)


STRUCT_OF = {"fwd_chain": "FwdParams", "fwd_out": "FwdParams", "bwd_local": "BwdParams",
             "bwd_chain": "BwdParams", "bwd_chain_fused": "BwdParams",
             "bwd_grads": "BwdParams", cc.DECODE_KERNEL: "DecodeParams"}


def _check_params(name, params, smem, tensors) -> None:
    """A launch's struct: the kernel's, every pointer null or inside a known tensor, the
    shared memory it tells the kernel that of the launch."""
    kernel = name.split("<")[0].removeprefix("ttt_linear_")
    assert type(params) is STRUCTS[STRUCT_OF[kernel]], f"{name}: {type(params).__name__}"
    for field, address in params.pointers().items():
        assert address == 0 or _inside(address, tensors), f"{name}: {field} points nowhere known"
    assert params.smem_bytes == smem, f"{name}: tells the kernel {params.smem_bytes} bytes, " \
                                      f"launches {smem}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [24, 100], ids=["D24", "D100"])
@pytest.mark.parametrize("lens", [(1,), (1, 0, 1)], ids=["dense", "varlen"])
@pytest.mark.parametrize("init", [False, True], ids=["no-h0", "h0"])
def test_decode_launch_arguments_match_kernel_signature(recording, dtype, D, lens, init):
    """A short generation step (placement.row_step): fwd_decode's one launch, each argument
    against its signature, every pointer null or inside a tensor of the call, the shared
    memory it is told that of the launch, a block per (sequence, head)."""
    p = _problem(dtype, D, lens, init)
    launcher.ttt_linear_fwd(p, save_for_backward=False, device=recording)
    (name, grid, block, smem, args), = recording.launches
    ctype = cc.CTYPES["bfloat16" if dtype == torch.bfloat16 else "float32"]
    assert name == cc.kernel_name(cc.DECODE_KERNEL, ctype, cc.d_pad(D), 16)
    _check_params(name, args, smem, recording.tensors)
    assert grid == len(lens) * 2 and block % 32 == 0
