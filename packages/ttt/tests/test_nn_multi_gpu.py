"""Two processes train like one: DDP and FSDP2 with bfloat16 mixed precision follow the
single-process float32 loss curve.

A small model (input projection, two ``TTTLinear`` layers with residuals, output projection)
takes ``STEPS`` SGD steps on fixed batches. The single process sees the whole batch; each of
the two processes sees its half, DDP averaging the gradients and FSDP2 (``fully_shard`` on
each layer and on the model) reduce-scattering them, so both follow the single-process
curve up to rounding. The printed loss of a step is the mean of the two halves' losses,
which equals the whole batch's mean loss.

Bound: each step's loss within ``TOLERANCES[dtype][0]`` relative of the single-process
float32 loss. For bfloat16 (``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`` for FSDP2, ``torch.autocast`` bfloat16 for DDP) that is the suite's
bfloat16 output bound, 1e-2: the loss is a mean of the model's outputs, whose error against
float32 the suite bounds by that tolerance, and the few small steps move the weights by
much less than the bfloat16 rounding of the activations. Measured on CPU with the reference
backend: at most about 6e-4 over 5 steps (float32: 1e-7). The float32 variant (CPU only) bounds the
difference, which then comes from the order of the gradient sums alone, by float32's 3e-6.

Variants:

- CPU, gloo, the reference backend, eager: runs everywhere, so the distributed code path is
  exercised in every test run (float32 and bfloat16).
- CUDA, NCCL, one GPU a process, bfloat16, for the backends ``reference``, ``triton`` and
  ``cupy``, eager and ``torch.compile`` (inductor): skip with the reason when fewer than two
  CUDA devices are present or the backend is not installed, not available, or does not take
  the layer's operator calls (its ``not_supported_reasons``).

The spawned processes run with NVLink multicast off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), set before NCCL starts.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _process_group import destroy_and_exit
from torch import nn

import ttt
import ttt.nn.layer
from ttt.testing.test_layer import TinyModel
from ttt.tolerances import TOLERANCES

WORLD = 2
WIDTH, HEADS, MINI_BATCH = 32, 2, 8
BATCH, SEQ = 4, 16                     # BATCH splits evenly over WORLD
STEPS = 5
LR = 0.2
KINDS = ("ddp", "fsdp2")
GPU_BACKENDS = ("reference", "triton", "cupy")
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
BACKEND_ERRORS = (ImportError, ValueError) + tuple(
    e for e in (getattr(ttt, "BackendError", None),) if isinstance(e, type))


@dataclass(frozen=True)
class Setup:
    """One run of the comparison: backend, device type, compile, and precision ("fp32" or
    "bf16") of the two-process runs (the single-process curve is always float32)."""

    backend: str
    device_type: str
    compile: bool
    precisions: tuple[str, ...]


def make_model(backend: str, device: torch.device) -> TinyModel:
    """The same model on every rank; every parameter off its initial value."""
    torch.manual_seed(0)
    model = TinyModel(backend, WIDTH, HEADS, MINI_BATCH)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.to(device)


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of a step: inputs and a target that a fixed map of them gives."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, SEQ, WIDTH, generator=g)
    mix = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH**0.5
    return x.to(device), torch.tanh(x @ mix).to(device)


def wrap(model: TinyModel, kind: str, precision: str, device: torch.device) -> nn.Module:
    if kind == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy()
        if precision == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def autocast(kind: str, precision: str, device: torch.device):
    """bfloat16 autocast, except under FSDP2 (whose policy casts the parameters)."""
    if precision == "bf16" and kind != "fsdp2":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def loss_curve(setup: Setup, kind: str, precision: str, device: torch.device) -> list[float]:
    """``STEPS`` SGD steps; each step's loss, the mean over the ranks. ``kind`` "single":
    one process, the whole batch."""
    rank, world = (0, 1) if kind == "single" else (dist.get_rank(), dist.get_world_size())
    model = make_model(setup.backend, device)
    step_model = wrap(model, kind, precision, device)
    if setup.compile:
        torch._dynamo.reset()
        step_model = torch.compile(
            step_model, backend="inductor" if device.type == "cuda" else "aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses = []
    for step in range(STEPS):
        x, target = batch(step, device)
        with autocast(kind, precision, device):
            out = step_model(x[rows])
        loss = (out.float() - target[rows]).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)                    # SUM and divide: gloo has no AVG
            loss /= world
        losses.append(loss.item())
    return losses


def _worker(rank: int, setup: Setup, init_file: str, result_file: str) -> None:
    os.environ.update(MULTICAST_OFF)                 # before NCCL starts
    cuda = setup.device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)                     # two processes on the CPU's cores
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=WORLD, device_id=device if cuda else None)
    try:
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        curves = {(kind, precision): loss_curve(setup, kind, precision, device)
                  for kind in KINDS for precision in setup.precisions}
        if rank == 0:
            torch.save(curves, result_file)
        dist.barrier()   # neither rank tears the group down while the other still talks
    except BaseException:
        dist.destroy_process_group()
        raise
    destroy_and_exit()


def two_process_curves(setup: Setup, folder) -> dict[tuple[str, str], list[float]]:
    """``{(kind, precision): curve}`` of two spawned processes."""
    os.environ.update(MULTICAST_OFF)                 # the spawned processes inherit it too
    mp.spawn(_worker, args=(setup, str(folder / "init"), str(folder / "curves.pt")),
             nprocs=WORLD)
    return torch.load(folder / "curves.pt")


def check_curves(setup: Setup, curves: dict, single: list[float]) -> None:
    assert single[-1] < 0.9 * single[0], f"the single-process loss barely moves: {single}"
    for (kind, precision), curve in curves.items():
        tol = TOLERANCES[torch.bfloat16 if precision == "bf16" else torch.float32][0]
        errors = [abs(a - b) / abs(b) for a, b in zip(curve, single)]
        assert max(errors) <= tol, (
            f"{kind} {precision} ({setup.backend}, {setup.device_type}, compile="
            f"{setup.compile}): per-step relative differences {errors} exceed {tol}; "
            f"curve {curve}, single process {single}")


# --- the operator calls of the layer, for the backend's own verdict ---------------------

def layer_calls(backend: str, device: torch.device) -> list[dict]:
    """The keyword arguments of the layer's ``chunk_ttt_linear`` calls in float32, under
    bfloat16 autocast (DDP) and with bfloat16 parameters (FSDP2's policy)."""
    calls = []

    def record(*args, **kwargs):
        names = ("q", "k", "v", "w", "b", "eta")
        calls.append({**dict(zip(names, args)), **kwargs})
        return args[0].clone(), None, None

    model = make_model(backend, device)
    x = batch(0, device)[0][: BATCH // WORLD]
    original = ttt.nn.layer.chunk_ttt_linear
    ttt.nn.layer.chunk_ttt_linear = record
    try:
        model(x)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            model(x)
        copy.deepcopy(model).to(torch.bfloat16)(x.to(torch.bfloat16))
    finally:
        ttt.nn.layer.chunk_ttt_linear = original
    return calls


def backend_skip_reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run the layer's calls here (None: it can)."""
    try:
        backend = ttt.load_backend(name)
    except BACKEND_ERRORS as exc:
        return f"backend {name}: {exc}"
    reason = backend.unavailable_reason()
    if reason:
        return f"backend {name} is unavailable: {reason}"
    for call in layer_calls(name, device):
        problem = ttt.make_problem(**{k: v for k, v in call.items() if k != "backend"})
        reasons = backend.not_supported_reasons(problem)
        if reasons:
            return f"backend {name} does not take the layer's calls: {'; '.join(reasons)}"
    return None


# --- the tests ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_curves(tmp_path_factory):
    """One pair of gloo processes computes every CPU curve."""
    setup = Setup("reference", "cpu", compile=False, precisions=("fp32", "bf16"))
    reason = backend_skip_reason(setup.backend, torch.device("cpu"))
    assert reason is None, reason
    return setup, two_process_curves(setup, tmp_path_factory.mktemp("cpu_curves"))


def test_two_cpu_processes_follow_the_single_process_curve(cpu_curves):
    setup, curves = cpu_curves
    assert set(curves) == {(k, p) for k in KINDS for p in ("fp32", "bf16")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # faster than two threads on a busy pair of cores
    try:
        single = loss_curve(setup, "single", "fp32", torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    check_curves(setup, curves, single)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_backend_verdict_on_the_layer_calls(backend):
    """The skip check of the GPU variants runs here too: the layer's three kinds of calls
    are recorded, the check gives a verdict (here: CPU tensors), and the reference backend
    takes them all."""
    calls = layer_calls(backend, torch.device("cpu"))
    assert len(calls) == 3 * len(TinyModel(backend, WIDTH, HEADS, MINI_BATCH).layers)
    assert {(c["q"].dtype, c["w"].dtype) for c in calls} == {
        (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16)}
    reason = backend_skip_reason(backend, torch.device("cpu"))
    assert reason is None or isinstance(reason, str)
    if backend == "reference":
        assert reason is None, reason


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_two_gpus_follow_the_single_gpu_curve(backend, compiled, tmp_path):
    count = torch.cuda.device_count()
    if count < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices (NCCL, one GPU a process), found {count}")
    reason = backend_skip_reason(backend, torch.device("cuda", 0))
    if reason:
        pytest.skip(reason)
    setup = Setup(backend, "cuda", compile=compiled, precisions=("bf16",))
    curves = two_process_curves(setup, tmp_path)
    single = loss_curve(setup, "single", "fp32", torch.device("cuda", 0))
    check_curves(setup, curves, single)
