"""NVIDIA's ``cuda-checkpoint`` utility, detected at run time (docs/jobs.md).

When it is on ``PATH``, ``gpusd run --cuda-checkpoint`` may use it to checkpoint a job's CUDA state
(``cuda-checkpoint --toggle --pid PID``) before a move instead of asking the job to checkpoint itself.
Verified only on a machine with a GPU; without the tool the job protocol is used.
"""

from __future__ import annotations

import os
import shutil


def find_cuda_checkpoint() -> str | None:
    """The path of an executable ``cuda-checkpoint`` on PATH, or None."""
    path = shutil.which("cuda-checkpoint")
    return path if path and os.access(path, os.X_OK) else None


def toggle_command(tool: str, pid: int) -> list[str]:
    """The command that suspends (or resumes) the CUDA state of ``pid``."""
    return [tool, "--toggle", "--pid", str(pid)]
