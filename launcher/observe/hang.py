"""A collective that did not finish within `dist_timeout`: which one, said in one line per rank.

gloo raises in the waiting rank once the timeout passes ("Timed out waiting 5000ms for recv operation");
NCCL's watchdog raises DistBackendError ("Watchdog caught collective operation timeout") and, with the
flight recorder on (strategies/ddp.py), dumps each rank's last collectives into <run_dir>/flight_recorder/.
"""

from __future__ import annotations

import os
import traceback
from typing import Optional

from launcher.errors import Hung

SIGNS = ("timed out waiting", "watchdog caught collective operation timeout", "operation timed out", "timeout after")


def timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(sign in text for sign in SIGNS)


def operation(error: BaseException) -> str:
    """What the rank waited in, from where the error was raised: torch.distributed's function, the
    gradient all-reduce inside backward, or a checkpoint's collectives."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace(os.sep, "/")
        if "torch/distributed/checkpoint/" in path:
            return "a checkpoint's collective (distributed.checkpoint)"
        if path.endswith("torch/distributed/distributed_c10d.py"):
            return f"torch.distributed.{frame.name}"
        if "torch/autograd/" in path:
            return "the gradient all-reduce of backward"
    return "a collective"


def report(error: BaseException, step: Optional[int], timeout: float, flight_recorder: Optional[str]) -> Hung:
    where = f"step {step}" if step is not None else "before the first step"
    dumped = f"; NCCL's flight recorder dumps: {flight_recorder}" if flight_recorder else ""
    return Hung(f"{where}: {operation(error)} did not finish within dist_timeout={timeout:g}s: another rank "
                f"stopped, hung or died (each rank that could says where it waited){dumped}. The newest complete "
                f"checkpoint is kept: the same command resumes from it")
