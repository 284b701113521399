"""examples/train_tiny_lm.py runs end to end: a few training steps, the plot step, and
generation with the cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_tiny_lm.py"


def test_tiny_lm_example_trains_and_generates(tmp_path):
    command = [sys.executable, str(EXAMPLE), "--steps", "3", "--batch-size", "2",
               "--seq-len", "20", "--width", "16", "--heads", "2", "--layers", "1",
               "--mini-batch", "4", "--sample-tokens", "9", "--device", "cpu",
               "--backend", "reference", "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "3 steps in" in run.stdout
    assert (tmp_path / "model.pt").is_file()
    sample = run.stdout.split("sample:\n", 1)[1]
    assert sample.startswith("The keeper ") and len(sample) == len("The keeper ") + 9 + 1
