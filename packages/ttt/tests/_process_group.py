"""How a test's spawned process that used a process group ends."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def destroy_and_exit() -> None:
    """Destroy the process group, then end this process at once (``os._exit(0)``): for a
    spawned worker whose results are saved and whose ranks all passed a barrier.

    PyTorch keeps a group that DDP or FSDP2 used alive past ``destroy_process_group``, and a
    gloo worker thread still releasing the last collective's tensors while the interpreter
    shuts down aborts the process (SIGABRT, ``terminate called without an active
    exception``). Ending at once skips that shutdown."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
