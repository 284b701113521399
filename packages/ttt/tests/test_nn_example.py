"""examples/train_tiny_lm.py runs end to end: a few training steps, the plot step, and
generation with the cache; in one process, and in two CPU processes (gloo) under torchrun
with ``--parallel ddp`` and ``--parallel fsdp2``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_tiny_lm.py"
TINY = ["--steps", "3", "--batch-size", "2", "--seq-len", "20", "--width", "16", "--heads",
        "2", "--layers", "1", "--mini-batch", "4", "--sample-tokens", "9", "--device", "cpu",
        "--backend", "reference"]
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK")

LAUNCHED = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
            "MASTER_PORT": "29500"}


def _env() -> dict[str, str]:
    """This environment without a surrounding torchrun's variables."""
    return {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}


def _check_output(run: subprocess.CompletedProcess, out: Path) -> str:
    assert run.returncode == 0, run.stderr
    assert "3 steps in" in run.stdout
    assert (out / "model.pt").is_file()
    assert run.stdout.count("sample:\n") == 1             # rank 0 alone prints
    sample = run.stdout.split("sample:\n", 1)[1]
    assert sample.startswith("The keeper ") and len(sample) == len("The keeper ") + 9 + 1
    return run.stdout


@pytest.mark.parametrize("inner", ["linear", "mlp"])
def test_tiny_lm_example_trains_and_generates(tmp_path, inner):
    command = [sys.executable, str(EXAMPLE), *TINY, "--inner", inner, "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=_env())
    _check_output(run, tmp_path)
    assert ("blocks.0.mixer.W2" in torch.load(tmp_path / "model.pt")) == (inner == "mlp")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_tiny_lm_example_under_torchrun(parallel, tmp_path):
    """Two gloo processes: rank 0 prints once, saves the whole model's state dict (the
    plain model's keys, plain tensors) and generates."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(EXAMPLE), *TINY, "--parallel", parallel,
               "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180, env=_env())
    stdout = _check_output(run, tmp_path)
    assert f"2 processes ({parallel})" in stdout
    state = torch.load(tmp_path / "model.pt")
    assert "embed.weight" in state and "blocks.0.mixer.W1" in state
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in state.values())


def _example_module():
    """The example imported as a module (registered: its dataclass needs that)."""
    name = "_ttt_example_train_tiny_lm"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--parallel", "ddp"], {}, "--parallel ddp: launch with torchrun"),
    (["--parallel", "fsdp2", "--device", "cpu"], {}, "--parallel fsdp2: launch with torchrun"),
    ([], {"WORLD_SIZE": "2"}, "torchrun started 2 processes but --parallel is none"),
    (["--parallel", "ddp", "--device", "cuda:1"], LAUNCHED, "pass --device cuda"),
    (["--parallel", "ddp", "--device", "mps"], LAUNCHED, "expected --device cpu (gloo)"),
])
def test_tiny_lm_example_launch_errors(argv, env, message, monkeypatch, capsys):
    """Misuse is one line on stderr and exit status 2, before any process group starts."""
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        _example_module().parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
