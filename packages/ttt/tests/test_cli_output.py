"""The command line's output: a closed pipe ends it quietly, ``--help`` shows defaults, and
the demo reports the median of several timed calls after warm-up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ttt import cli

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_tiny_lm.py"


@pytest.mark.parametrize("command", ["info", "capabilities"])
def test_a_closed_pipe_ends_quietly(command):
    """``python -m ttt info | head -2``: the reader is gone before the output is written;
    no traceback, no "Exception ignored" at exit."""
    proc = subprocess.Popen([sys.executable, "-m", "ttt", command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()                  # before the child (importing torch) writes a byte
    err = proc.stderr.read().decode()
    status = proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert "Exception ignored" not in err, err
    assert err == ""
    assert status == 1


def test_a_pipe_closed_after_the_first_lines_ends_quietly():
    shell = f"{sys.executable} -m ttt info | head -2"
    run = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=120)
    assert run.stderr == "", run.stderr
    assert len(run.stdout.splitlines()) == 2


def _help(argv) -> str:
    run = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return " ".join(run.stdout.split())


@pytest.mark.parametrize("option, default", [("--seq-len", "256"), ("--heads", "4"),
                                             ("--head-dim", "64"), ("--chunk-size", "16"),
                                             ("--batch", "2"), ("--repeat", "10"),
                                             ("--warmup", "2")])
def test_demo_help_shows_defaults(option, default):
    text = _help(["-m", "ttt", "demo"])
    assert re.search(rf"{option} \S+ .*?\(default: {default}\)", text), text


@pytest.mark.parametrize("option, default", [("--steps", "120"), ("--batch-size", "16"),
                                             ("--width", "64"), ("--layers", "2"),
                                             ("--lr", "0.005"), ("--seed", "0"),
                                             ("--temperature", "0.8")])
def test_example_help_shows_defaults(option, default):
    text = _help([str(EXAMPLE)])
    assert re.search(rf"{option} \S+ .*?\(default: {default}\)", text), text


def test_help_shows_no_default_of_none():
    assert "(default: None)" not in _help(["-m", "ttt", "demo"])
    assert "(default: None)" not in _help(["-m", "ttt", "warmup"])
    assert "(default: None)" not in _help([str(EXAMPLE)])


def test_demo_times_the_median_of_several_calls_after_warm_up(capsys, monkeypatch):
    calls = []
    real = cli.time.perf_counter

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(cli.time, "perf_counter", counting)
    status = cli.main(["demo", "--device", "cpu", "--seq-len", "20", "--heads", "1",
                       "--head-dim", "8", "--warmup", "1", "--repeat", "5"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert re.search(r"forward \+ backward: [0-9.]+ ms median of 5 calls \(min [0-9.]+, "
                     r"max [0-9.]+\) after 1 warm-up call", out), out
    assert len(calls) == 2 * 5           # a start and a stop per timed call
    assert "demo passed" in out


def test_demo_refuses_zero_repeats(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--repeat", "0"])
    assert "--repeat" in capsys.readouterr().err
