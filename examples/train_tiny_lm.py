"""Train a tiny character-level language model of TTT-Linear blocks, then generate.

    python examples/train_tiny_lm.py                      # CPU, tiny size
    python examples/train_tiny_lm.py --device cuda --steps 2000 --width 256 --layers 4
    python examples/train_tiny_lm.py --text my.txt --backend reference --compile

Each block is pre-norm residual: ``x + TTTLinear(LN(x))``, then ``x + MLP(LN(x))``. The
default text is ``examples/tiny_corpus.txt`` (a few KB written for this repository). At
the end the model generates from a prompt with a :class:`ttt.nn.TTTCache`: one prefill of
the prompt, then one token per step. A progress bar uses tqdm when it is installed, and the
loss curve is saved as a PNG when matplotlib is.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ttt.nn import TTTCache, TTTLinear

DEFAULT_TEXT = Path(__file__).with_name("tiny_corpus.txt")


class CharTokenizer:
    """One token per distinct character of the training text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text if c in self.index], dtype=torch.long)

    def decode(self, tokens) -> str:
        return "".join(self.chars[int(t)] for t in tokens)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mini_batch: int, backend: str | None) -> None:
        super().__init__()
        self.mixer_norm = nn.LayerNorm(width)
        self.mixer = TTTLinear(width, heads, mini_batch, backend=backend)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, cache: TTTCache | None = None) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, mini_batch: int,
                 backend: str | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, mini_batch, backend)
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
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT,
                   help="training text file (default: examples/tiny_corpus.txt)")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="training windows per step")
    p.add_argument("--seq-len", type=int, default=64, help="training window in characters")
    p.add_argument("--width", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="TTT-Linear blocks")
    p.add_argument("--heads", type=int, default=4, help="heads per TTT-Linear layer")
    p.add_argument("--mini-batch", type=int, default=16, help="TTT inner mini-batch (chunk)")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate")
    p.add_argument("--backend", default=None,
                   help="ttt backend of the TTTLinear layers (default: chosen by ttt; of the "
                        "built-in backends only reference takes the layer's calls)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda if present, else cpu)")
    p.add_argument("--out", type=Path, default=Path("tiny_lm_out"),
                   help="folder for loss.png and model.pt")
    p.add_argument("--prompt", default="The keeper ", help="start of the generated text")
    p.add_argument("--sample-tokens", type=int, default=200,
                   help="characters generated after the prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "width", "layers", "heads", "mini_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int")
    if not args.temperature > 0 or args.sample_tokens < 0:
        p.error("--temperature: expected > 0; --sample-tokens: expected >= 0")
    return args


def progress(iterable, total: int):
    """tqdm when installed, else a one-line text bar on stderr."""
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


def train(model: nn.Module, data: torch.Tensor, args) -> list[float]:
    step_model = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    losses = []
    bar = progress(range(args.steps), args.steps)
    for step in bar:
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))   # cosine decay
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = (t.to(args.device) for t in
                           random_windows(data, args.batch_size, args.seq_len, gen))
        logits = step_model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


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
    ax.set_title("tiny TTT-Linear LM")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss plot: {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    text = args.text.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    if data.numel() <= args.seq_len + 1:
        raise SystemExit(f"--text: {args.text} has {data.numel()} characters, "
                         f"need more than --seq-len + 1 = {args.seq_len + 1}")
    model = TinyLM(len(tokenizer.chars), args.width, args.layers, args.heads,
                   args.mini_batch, args.backend).to(args.device)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, vocab "
          f"{len(tokenizer.chars)}, {data.numel():,} characters, device {args.device}")

    start = time.perf_counter()
    losses = train(model, data, args)
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out / "model.pt")
    save_plot(losses, args.out / "loss.png")

    prompt = tokenizer.encode(args.prompt)       # characters not in the text are dropped
    if prompt.numel() == 0:
        prompt = data[:1]
    sampled = generate(model, prompt.to(args.device), args.sample_tokens, args.temperature,
                       torch.Generator().manual_seed(args.seed))
    print("sample:\n" + tokenizer.decode(prompt.tolist()) + tokenizer.decode(sampled))


if __name__ == "__main__":
    main()
