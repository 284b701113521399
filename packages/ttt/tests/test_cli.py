"""The command line: ``python -m ttt info`` and ``python -m ttt demo``."""

from __future__ import annotations

import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ttt", *args], capture_output=True, text=True)


def test_info_lists_backends():
    out = _run("info")
    assert out.returncode == 0, out.stderr
    assert "reference" in out.stdout and "torch" in out.stdout and "device:" in out.stdout


def test_demo_checks_against_the_oracle():
    out = _run("demo", "--device", "cpu", "--seq-len", "40", "--heads", "2", "--head-dim", "16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo passed" in out.stdout and "dq" in out.stdout
