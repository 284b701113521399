"""Data-parallel training of TTTLinear: two CPU processes (gloo) give the gradients of one.

DDP averages the gradients of the two half batches; FSDP2 (``fully_shard``) shards every
parameter over the two processes and reduce-scatters the gradients. Either way, each
parameter's gradient equals the single-process gradient of the mean loss over the batch.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _process_group import destroy_and_exit
from torch import nn
from torch.distributed.tensor import DTensor

from ttt.nn import TTTLinear

WORLD = 2
BATCH, SEQ, WIDTH = 4, 11, 16
FP64_RTOL = 1e-10
FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")
"""FSDP2 (fully_shard) runs on the CPU only where its stream has ``record_event`` (not in
torch 2.5 and 2.6)."""
KINDS = ("ddp", "fsdp2") if FSDP2_ON_CPU else ("ddp",)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = TTTLinear(WIDTH, 2, 4, use_gate=True, backend="reference",
                               dtype=torch.float64)
        self.head = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x):
        return self.head(x + self.mixer(x))


def _model() -> _Model:
    torch.manual_seed(0)
    model = _Model()
    with torch.no_grad():                    # every parameter off its initial value
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def _batch():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, WIDTH, generator=gen, dtype=torch.float64)
    target = torch.randn(BATCH, SEQ, WIDTH, generator=gen, dtype=torch.float64)
    return x, target


def _loss(model, x, target):
    return (model(x) - target).square().mean()


def _wrap(model: _Model, kind: str) -> nn.Module:
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.mixer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _gradients(model: _Model, kind: str, rank: int) -> dict[str, torch.Tensor]:
    """This rank's half batch through the wrapped model; the full gradients."""
    wrapped = _wrap(model, kind)
    x, target = _batch()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    _loss(wrapped, x[rows], target[rows]).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return grads


def _worker(rank: int, init_file: str, result_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        grads = {kind: _gradients(_model(), kind, rank) for kind in KINDS}
        if rank == 0:
            torch.save(grads, result_file)
        dist.barrier()   # neither rank tears gloo down while the other still talks to it
    except BaseException:
        dist.destroy_process_group()
        raise
    destroy_and_exit()


@pytest.fixture(scope="module")
def distributed_gradients(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """One pair of processes computes the gradients for every kind of wrapping."""
    folder = tmp_path_factory.mktemp("distributed")
    mp.spawn(_worker, args=(str(folder / "init"), str(folder / "grads.pt")), nprocs=WORLD)
    return torch.load(folder / "grads.pt")


@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp2", marks=pytest.mark.skipif(
    not FSDP2_ON_CPU, reason="FSDP2 does not run on the CPU with this torch"))])
def test_two_processes_give_the_single_process_gradients(kind, distributed_gradients):
    got = distributed_gradients[kind]
    model = _model()
    _loss(model, *_batch()).backward()
    assert got.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        err = ((got[name] - param.grad).norm() / param.grad.norm()).item()
        assert err < FP64_RTOL, (name, err)
