"""Train a tiny character-level language model of TTT-Linear (or TTT-MLP) blocks, then
generate.

    python examples/train_tiny_lm.py                      # CPU, tiny size
    python examples/train_tiny_lm.py --inner mlp          # TTT-MLP blocks
    python examples/train_tiny_lm.py --device cuda --steps 2000 --width 256 --layers 4
    python examples/train_tiny_lm.py --text my.txt --backend reference --compile
    torchrun --nproc-per-node 2 examples/train_tiny_lm.py --parallel ddp     # one GPU a process
    torchrun --nproc-per-node 2 examples/train_tiny_lm.py --parallel fsdp2 --mixed-precision bf16

Each block is pre-norm residual: ``x + TTTLinear(LN(x))`` (``TTTMLP`` with ``--inner mlp``),
then ``x + MLP(LN(x))``. The
default text is ``examples/tiny_corpus.txt`` (a few KB written for this repository). At
the end the model generates from a prompt with a :class:`ttt.nn.TTTCache`: one prefill of
the prompt, then one token per step. A progress bar uses tqdm when it is installed, and the
loss curve is saved as a PNG when matplotlib is.

Under torchrun, ``--parallel ddp`` (DistributedDataParallel) or ``--parallel fsdp2``
(``fully_shard`` on every block and on the model) trains one replica a process: NCCL and
``cuda:LOCAL_RANK`` on GPUs, gloo with ``--device cpu``. ``--batch-size`` is per process;
each rank draws its own windows (seed + rank) and the printed loss is the mean over ranks.
Rank 0 alone prints, saves the full state dict and generates with a plain copy of the model.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ttt.nn import TTTMLP, TTTCache, TTTLinear

DEFAULT_TEXT = Path(__file__).with_name("tiny_corpus.txt")
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class CharTokenizer:
    """One token per distinct character of the training text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text if c in self.index], dtype=torch.long)

    def decode(self, tokens) -> str:
        return "".join(self.chars[int(t)] for t in tokens)


MIXERS = {"linear": TTTLinear, "mlp": TTTMLP}


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mini_batch: int, backend: str | None,
                 inner: str = "linear") -> None:
        super().__init__()
        self.mixer_norm = nn.LayerNorm(width)
        self.mixer = MIXERS[inner](width, heads, mini_batch, backend=backend)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, cache: TTTCache | None = None) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, mini_batch: int,
                 backend: str | None, inner: str = "linear") -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, mini_batch, backend, inner)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, cache: TTTCache | None = None) -> torch.Tensor:
        x = self.embed(tokens)                                       # [B, T, width]
        for block in self.blocks:
            x = block(x, cache=cache)
        return self.head(self.norm(x))                               # [B, T, vocab]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where the help says it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="training text file")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16,
                   help="training windows per step (per process under --parallel)")
    p.add_argument("--seq-len", type=int, default=64, help="training window in characters")
    p.add_argument("--width", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="residual blocks")
    p.add_argument("--heads", type=int, default=4, help="TTT heads per block")
    p.add_argument("--mini-batch", type=int, default=16, help="TTT inner mini-batch (chunk)")
    p.add_argument("--inner", choices=tuple(MIXERS), default="linear",
                   help="the TTT layers' inner model: linear (TTTLinear) or a two-layer MLP "
                        "(TTTMLP)")
    p.add_argument("--lr", type=float, default=5e-3, help="peak AdamW learning rate")
    p.add_argument("--backend", default=None,
                   help="ttt backend of the TTT layers (default: chosen by ttt, the "
                        "best that takes the layer's calls: a GPU backend on CUDA, reference "
                        "on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda if present; under --parallel each process "
                        "takes cuda:LOCAL_RANK)")
    p.add_argument("--parallel", choices=("none", "ddp", "fsdp2"), default="none",
                   help="data parallelism over torchrun's processes: DistributedDataParallel "
                        "or FSDP2 (fully_shard)")
    p.add_argument("--mixed-precision", choices=("none", "bf16"), default="none",
                   help="bf16: FSDP2's MixedPrecisionPolicy (bf16 parameters, float32 "
                        "gradient reduction), else torch.autocast")
    p.add_argument("--out", type=Path, default=Path("tiny_lm_out"),
                   help="folder for loss.png and model.pt")
    p.add_argument("--prompt", default="The keeper ", help="generation prompt")
    p.add_argument("--sample-tokens", type=int, default=200, help="characters to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model and of the windows (rank r draws with seed + r)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "width", "layers", "heads", "mini_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int")
    if not args.temperature > 0 or args.sample_tokens < 0:
        p.error("--temperature: expected > 0; --sample-tokens: expected >= 0")
    check_launch(p, args)
    return args


def check_launch(p: argparse.ArgumentParser, args) -> None:
    """One-line errors for a launch that cannot work."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.parallel == "none":
        if world > 1:
            p.error(f"torchrun started {world} processes but --parallel is none: pass "
                    "--parallel ddp or --parallel fsdp2 (or run with plain python)")
        return
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        p.error(f"--parallel {args.parallel}: launch with torchrun, e.g. `torchrun "
                f"--nproc-per-node 2 {sys.argv[0]} --parallel {args.parallel}` (missing "
                f"environment: {', '.join(missing)})")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda"):
        p.error(f"--parallel {args.parallel}: expected --device cpu (gloo) or cuda (NCCL), "
                f"got {args.device}")
    if device.type == "cuda":
        if device.index is not None:
            p.error(f"--device {args.device}: under --parallel each process takes "
                    "cuda:LOCAL_RANK; pass --device cuda")
        local_rank, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        if local_rank >= count:
            p.error(f"LOCAL_RANK {local_rank} but {count} CUDA device(s) here: start at "
                    f"most {count} processes a node (torchrun --nproc-per-node {count}), "
                    "or pass --device cpu")


@dataclass(frozen=True)
class Rank:
    """This process's place: rank 0 of 1 without --parallel."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(args) -> Rank:
    """The process group from torchrun's environment: NCCL on cuda:LOCAL_RANK, else gloo."""
    if args.parallel == "none":
        return Rank(device=torch.device(args.device))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return Rank(dist.get_rank(), dist.get_world_size(), device)


def wrap_model(model: TinyLM, args, rank: Rank) -> nn.Module:
    """The module the training steps call: the model itself, DDP around it, or the model
    with every block and the whole model sharded in place by FSDP2 (``fully_shard``)."""
    if args.parallel == "ddp":
        ids = [rank.device.index] if rank.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if args.parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(rank.device.type, (rank.world,))
        policy = MixedPrecisionPolicy()
        if args.mixed_precision == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def autocast(args, rank: Rank):
    """bf16 autocast for --mixed-precision bf16 without FSDP2 (whose policy casts)."""
    if args.mixed_precision == "bf16" and args.parallel != "fsdp2":
        return torch.autocast(rank.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def mean_over_ranks(loss: torch.Tensor, rank: Rank) -> float:
    """The loss averaged over the ranks (SUM then divide: gloo has no AVG)."""
    loss = loss.detach().float()
    if rank.world > 1:
        dist.all_reduce(loss)
        loss /= rank.world
    return loss.item()


def progress(iterable, total: int, show: bool = True):
    """tqdm when installed, else a one-line text bar on stderr; nothing when not ``show``."""
    if not show:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return _text_bar(iterable, total)
    return tqdm(iterable, total=total, desc="train")


def _text_bar(iterable, total: int, width: int = 30):
    for i, item in enumerate(iterable, 1):
        yield item
        done = width * i // total
        sys.stderr.write(f"\rtrain [{'#' * done}{'.' * (width - done)}] {i}/{total}")
        sys.stderr.flush()
    sys.stderr.write("\n")


def random_windows(data: torch.Tensor, batch: int, length: int, gen: torch.Generator):
    """``batch`` random windows of ``length + 1`` tokens: inputs and next-token targets."""
    starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=gen)
    rows = torch.stack([data[s:s + length + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def train(model: TinyLM, data: torch.Tensor, args, rank: Rank) -> list[float]:
    """``args.steps`` AdamW steps; the loss of each step (the mean over the ranks)."""
    wrapped = wrap_model(model, args, rank)
    step_model = torch.compile(wrapped) if args.compile else wrapped
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + rank.rank)
    losses = []
    bar = progress(range(args.steps), args.steps, show=rank.main)
    for step in bar:
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))   # cosine decay
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = (t.to(rank.device) for t in
                           random_windows(data, args.batch_size, args.seq_len, gen))
        with autocast(args, rank):
            logits = step_model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(mean_over_ranks(loss, rank))
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def full_state_dict(model: nn.Module, args) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU, on rank 0 (empty on the other ranks); every rank
    must call it under --parallel."""
    if args.parallel == "none":
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def generate(model: TinyLM, prompt: torch.Tensor, count: int, temperature: float,
             gen: torch.Generator) -> list[int]:
    """Prefill the prompt into a cache, then sample one token per step."""
    model.eval()
    cache = TTTCache()
    logits = model(prompt[None], cache=cache)[0, -1]
    tokens = []
    for _ in range(count):
        probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
        token = int(torch.multinomial(probs, 1, generator=gen))
        tokens.append(token)
        step = torch.tensor([[token]], device=prompt.device)
        logits = model(step, cache=cache)[0, -1]
    return tokens


def save_plot(losses: list[float], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / char)")
    ax.set_title("tiny TTT LM")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss plot: {path}")


def build_model(vocab: int, args, device: torch.device) -> TinyLM:
    torch.manual_seed(args.seed)                 # the same initial model on every rank
    return TinyLM(vocab, args.width, args.layers, args.heads, args.mini_batch,
                  args.backend, args.inner).to(device)


def plain_model(model: TinyLM, state: dict[str, torch.Tensor], vocab: int, args,
                device: torch.device) -> TinyLM:
    """The trained model as a plain single-process module: itself without --parallel, else
    a fresh one loaded with the gathered state dict."""
    if args.parallel == "none":
        return model
    plain = build_model(vocab, args, device)
    plain.load_state_dict(state)
    return plain


def finish(model: TinyLM, state: dict[str, torch.Tensor], losses: list[float],
           tokenizer: CharTokenizer, data: torch.Tensor, args, device: torch.device) -> None:
    """Rank 0: save the model and the plot, then generate with the plain model."""
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.out / "model.pt")
    save_plot(losses, args.out / "loss.png")
    model = plain_model(model, state, len(tokenizer.chars), args, device)
    prompt = tokenizer.encode(args.prompt)       # characters not in the text are dropped
    if prompt.numel() == 0:
        prompt = data[:1]
    sampled = generate(model, prompt.to(device), args.sample_tokens, args.temperature,
                       torch.Generator().manual_seed(args.seed))
    print("sample:\n" + tokenizer.decode(prompt.tolist()) + tokenizer.decode(sampled))


def main(argv=None) -> None:
    args = parse_args(argv)
    text = args.text.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    if data.numel() <= args.seq_len + 1:
        raise SystemExit(f"--text: {args.text} has {data.numel()} characters, "
                         f"need more than --seq-len + 1 = {args.seq_len + 1}")
    rank = init_distributed(args)
    try:
        model = build_model(len(tokenizer.chars), args, rank.device)
        if rank.main:
            where = (f"{rank.world} processes ({args.parallel}), device {rank.device.type}"
                     if args.parallel != "none" else f"device {args.device}")
            print(f"{sum(p.numel() for p in model.parameters()):,} parameters, vocab "
                  f"{len(tokenizer.chars)}, {data.numel():,} characters, {where}")
        start = time.perf_counter()
        losses = train(model, data, args, rank)
        elapsed = time.perf_counter() - start
        state = full_state_dict(model, args)     # a collective: every rank takes part
        if rank.main:
            print(f"{args.steps} steps in {elapsed:.1f} s, "
                  f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            finish(model, state, losses, tokenizer, data, args, rank.device)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if dist.is_initialized():
        leave_process_group()


def leave_process_group() -> None:
    """Destroy the process group; under gloo, then end the process at once.

    PyTorch keeps a gloo group that DDP or FSDP2 used alive past ``destroy_process_group``,
    and its worker thread may still be releasing the last collective's tensors when the
    interpreter shuts down: that thread then aborts the process (``terminate called
    without an active exception``). Leaving with ``os._exit`` after a barrier skips the
    shutdown; everything this script writes is closed by then."""
    gloo = dist.get_backend() == "gloo"
    if gloo:
        dist.barrier()
    dist.destroy_process_group()
    if gloo:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
