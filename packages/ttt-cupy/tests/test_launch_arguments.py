"""No GPU needed: every launch of the cupy launcher against the signature of its kernel.

The launcher builds each kernel's arguments by hand (raw ``data_ptr()`` values and numpy
scalars), and a kernel reads them by position: an argument too many, too few or of the wrong
width is not an error CUDA reports, it is garbage. Here the whole forward and backward run on
CPU tensors through the launcher's device seam (``conftest.RecordingDevice``); each launch
is recorded and its arguments checked, one by one, against the parameters of the
``__global__`` function in ``csrc/*.cu`` (a pointer is a 64-bit address, ``float`` a numpy
float32, ``int`` int32, ``long long`` int64): for the fused and unfused forward and backward,
one launch and segmented passes, dense and varlen, with and without initial states, tensor-core
and SIMT instances. It also checks which instances each pass launches and how often, the
shared-memory size the kernel is told (its last argument) against the launch's, a block of
whole warps, and that every pointer is null or inside a tensor the launcher handed to the
device.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from ttt import make_problem
from ttt_cupy import compile as cc
from ttt_cupy import launcher
from ttt_cupy.config import Schedule, config
from ttt_cupy.placement import segment_plan
from ttt_cupy.smem import grads_split

_SCALAR = {"float": np.float32, "int": np.int32, "long long": np.int64,
           "unsigned long long": np.uint64}


@functools.cache
def _signatures() -> dict[str, list[type]]:
    """{kernel name: the numpy type of each parameter} of every ``__global__`` function."""
    sigs = {}
    for path in cc.CSRC.glob("*.cu"):
        text = re.sub(r"//[^\n]*", "", path.read_text())
        for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?"
                             r"(\w+)\s*\(([^)]*)\)\s*\{", text):
            types = []
            for param in m.group(2).split(","):
                decl = param.split("=")[0].strip()
                if "*" in decl:
                    types.append(np.uint64)
                    continue
                base = re.sub(r"\b(const|__restrict__)\b", "", decl).rsplit(None, 1)[0]
                types.append(_SCALAR[" ".join(base.split())])
            sigs[m.group(1)] = types
    return sigs


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
        sync = int(c_args[-2])
        assert sync != 0 and int(o_args[-5]) == sync == int(k_args[-5]), "sync buffers"
        assert (int(o_args[-4]), int(k_args[-4])) == (1, 2), "the group kernel's modes"
        tickets = p.N * p.H * saved.groups.groups_max * per_item
        assert int(o_args[-3]) == int(k_args[-3]) == p.N * p.H
        assert o_grid == k_grid == tickets
        syncs.append(sync)
    assert recording.waits == [(a, p.N * p.H) for a in syncs], recording.waits

    sigs = _signatures()
    tensors = recording.tensors    # (every tensor whose address the launcher took)
    for name, grid, block, smem, args in launches:
        params = sigs[name.split("<")[0]]
        assert len(args) == len(params), \
            f"{name}: {len(args)} arguments, the kernel takes {len(params)}"
        for i, (arg, want) in enumerate(zip(args, params)):
            assert type(arg) is want, \
                f"{name}: argument {i} is {type(arg).__name__}, the kernel reads {want.__name__}"
            if want is np.uint64 and i < len(args) - 1 and int(arg) != 0:
                assert _inside(int(arg), tensors), f"{name}: argument {i} points nowhere known"
        assert int(args[-1]) == smem, f"{name}: tells the kernel {args[-1]} bytes, launches {smem}"
        assert grid > 0 and block % 32 == 0 and 0 < block <= 1024, (name, grid, block)


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
    params = _signatures()[f"ttt_linear_{cc.DECODE_KERNEL}"]
    assert [type(a) for a in args] == params
    for i, arg in enumerate(args[:-1]):
        if params[i] is np.uint64 and int(arg) != 0:
            assert _inside(int(arg), recording.tensors), f"argument {i} points nowhere known"
    assert int(args[-1]) == smem and grid == len(lens) * 2 and block % 32 == 0


def test_the_devices_pointers_are_its_pointer_of_each_tensor():
    """``CudaDevice.pointers`` (one array of addresses for a launch's tensors) gives what
    ``pointer`` gives for each, numpy uint64 scalars, null for None, in order."""
    from ttt_cupy.device import CudaDevice

    tensors = (torch.empty(3), None, torch.empty(2, 5)[1], torch.empty(0), None)
    got = CudaDevice.pointers(*tensors)
    want = tuple(CudaDevice.pointer(t) for t in tensors)
    assert got == want and [type(a) for a in got] == [np.uint64] * len(tensors)
    assert got[2] == tensors[2].data_ptr() and got[1] == 0
