"""Stopping on a signal: Slurm's warning before the time limit (SIGUSR1), SIGTERM, Ctrl-C.

The handler only sets a flag. At a step boundary the ranks agree (one small collective on the
host, every few steps when there are several ranks), the loop saves a checkpoint and stops; under
Slurm global rank 0 then requeues the job, and the requeued job resumes from that checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Callable, Dict, Optional

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
CHECK_EVERY = 10  # steps between agreements when there are several ranks: one host collective each


class Stopped(Exception):
    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")


class StopFlag:
    def __init__(self, ranks: int):
        self.signum = 0
        self.every = 1 if ranks == 1 else CHECK_EVERY
        self.previous: Dict[int, object] = {}

    def install(self) -> "StopFlag":
        for sig in SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C does not wait for the step boundary
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def agreed(self, step: int, max_over_ranks: Callable[[int], int]) -> Optional[int]:
        """The signal every rank stops for after `step`, or None to go on. Collective on `every` steps."""
        if step % self.every:
            return None
        signum = max_over_ranks(self.signum) if self.every > 1 else self.signum
        return signum or None


def requeue(env=os.environ) -> Optional[str]:
    """Under Slurm, put this job back in the queue (the array task, for an array job); a line to say.
    Raises RequeueFailed if Slurm refuses."""
    if "SLURM_JOB_ID" not in env:
        return None
    job = env["SLURM_JOB_ID"]
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RequeueFailed(f"scontrol requeue {job} failed: {reason}. HINT: submit with --requeue "
                            f"(the slurm/ templates do); the checkpoint is saved, so resubmitting resumes")
    return f"requeued Slurm job {job}: it resumes from the checkpoint"


class RequeueFailed(Exception):
    pass


def exit_code(signum: int, env=os.environ) -> int:
    """Under Slurm every process exits cleanly (0): the job was saved and requeued. Elsewhere the
    shell's convention, 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM."""
    return 0 if "SLURM_JOB_ID" in env else 128 + signum
