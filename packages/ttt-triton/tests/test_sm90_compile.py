"""No GPU needed: every kernel launch of the launcher's main paths compiles for sm_90, each
within sm90_compile.STACK_LIMIT bytes of stack per thread (sm90_compile.py, one child
process per case without ``TRITON_INTERPRET``, sharing one Triton cache; the float32 chunk-64
cases, minutes each on a CPU, are marked ``big``). The interpreter the CPU suite runs does
not check what the compiler does: a loop-carried variable that changes type, for one,
compiles nowhere but runs there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from sm90_compile import CASES, SLOW_CASES  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("on a GPU the suite compiles every kernel for the GPU it runs on",
                allow_module_level=True)

SCRIPT = Path(__file__).with_name("sm90_compile.py")


@pytest.fixture(scope="session")
def triton_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp().parent / "sm90-triton-cache"


@pytest.mark.parametrize("case", [case.label for case in CASES] + [
    pytest.param(case.label, marks=pytest.mark.big) for case in SLOW_CASES])
def test_launches_compile_for_sm90(case, triton_cache):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(triton_cache), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--case", case], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " 0 failed" in done.stdout, done.stdout
