"""Stopping on a signal: Slurm's warning before the time limit (SIGUSR1), SIGTERM, Ctrl-C.

The handler only sets a flag. At a step boundary the ranks agree, the loop saves a checkpoint and
stops; under Slurm global rank 0 then requeues the job, and the requeued job resumes from that
checkpoint.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# With several ranks, at each check every rank starts an all-reduce on the host of its flag and of
# how many steps it would wait until the next check, and reads the one it started at the check
# before, which has long finished: the loop never waits on it, and every rank reads the same values
# at the same step. The next check comes after the fewest steps any rank proposed: about
# CHECK_SECONDS of its steps, at least one. A collective every few milliseconds would cost a small
# DDP step 10% (measured on two cores), one every half second costs nothing; a signal is acted on
# within two intervals, about a second.
FIRST_CHECK = 10  # the step of the first check, before any step has been timed
CHECK_SECONDS = 0.5
MAX_INTERVAL = 1000
# Set by launcher/placement/spawn.py for the workers it starts: the pid of the process they must not outlive.
PARENT = "LAUNCHER_PARENT_PID"


class Stopped(Exception):
    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")


class StopFlag:
    def __init__(self, ranks: int):
        self.signum = 0
        self.ranks = ranks
        self.previous: Dict[int, object] = {}
        self.pending: Optional[Callable[[], List[int]]] = None  # the agreement started at the last check
        self.next_check: Optional[int] = None
        self.last: tuple = (0, 0.0)  # (step, time) of the last check
        self.watching = False

    def install(self) -> "StopFlag":
        for sig in SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        parent = os.environ.get(PARENT)
        if parent and parent.isdigit() and not self.watching:  # started as its child: gone if no longer its parent
            self.watching = True
            threading.Thread(target=self._watch_parent, args=(int(parent),), name="launcher-parent", daemon=True).start()
        return self

    def _watch_parent(self, parent: int) -> None:
        """A worker that `python -m launcher ... strategy=ddp` started: when that process is gone, however
        it died (kill -9 gives the workers no signal: torchrun starts them in sessions of their own), the
        worker stops as on SIGTERM, saving at the step every rank agrees on. Two reads of the parent's pid
        a second."""
        while os.getppid() == parent:
            time.sleep(0.5)
        if not self.signum:
            print(f"launcher: rank {os.environ.get('RANK', '0')}: the launcher that started this worker (pid "
                  f"{parent}) is gone; stopping as on SIGTERM", file=sys.stderr, flush=True)
            self.signum = signal.SIGTERM

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C does not wait for the step boundary
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def agreed(self, step: int, reduce_max: Callable[[List[int]], Callable[[], List[int]]]) -> Optional[int]:
        """The signal every rank stops for after `step`, or None to go on. Collective at each check."""
        if self.ranks == 1:
            return self.signum or None
        if self.next_check is None:
            self.next_check = (step // FIRST_CHECK + 1) * FIRST_CHECK  # the same on every rank
        if step < self.next_check:
            return None
        signum, minus_interval = self.pending() if self.pending is not None else (0, -FIRST_CHECK)
        self.pending = None
        if signum:
            return signum
        now = time.monotonic()
        pace = (now - self.last[1]) / max(step - self.last[0], 1) if self.last[0] else 0.0
        proposal = max(1, min(MAX_INTERVAL, int(CHECK_SECONDS / pace))) if pace > 0 else FIRST_CHECK
        self.last = (step, now)
        self.pending = reduce_max([self.signum, -proposal])  # MAX of the flags, MIN of the proposals
        self.next_check = step - minus_interval
        return None

    def finish(self) -> None:
        """Wait for the agreement still in flight (every rank started it), before the group goes."""
        if self.pending is not None:
            self.pending()
            self.pending = None


def requeue(env=os.environ) -> Optional[str]:
    """Under Slurm, put this job back in the queue (the array task, for an array job); a line to say.
    Raises RequeueFailed if Slurm refuses."""
    if "SLURM_JOB_ID" not in env:
        return None
    job = env["SLURM_JOB_ID"]
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and not _taken_back(job, done.returncode, env):
        reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RequeueFailed(f"scontrol requeue {job} failed: {reason}. HINT: submit with --requeue "
                            f"(the slurm/ templates do); the checkpoint is saved, so resubmitting resumes")
    return f"requeued Slurm job {job}: it resumes from the checkpoint"


def _taken_back(job: str, code: int, env) -> bool:
    """Whether Slurm requeued the job though scontrol did not say so. The requeue ends every process of the job,
    scontrol among them: on a busy node it can be killed (a signal, no message) before slurmctld's answer reaches
    it. So the job's own record decides: restarted more often than this run knows, or waiting in the queue again."""
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    if shown.returncode < 0:  # this one killed too: by the requeue, which is under way
        return code < 0
    restarts = re.search(r"\bRestarts=(\d+)", shown.stdout)
    state = re.search(r"\bJobState=(\S+)", shown.stdout)
    return bool(restarts and int(restarts.group(1)) > int(env.get("SLURM_RESTART_COUNT") or 0)) or \
        bool(state and state.group(1) in ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"))


class RequeueFailed(Exception):
    pass


def exit_code(signum: int, env=os.environ) -> int:
    """Under Slurm every process exits cleanly (0): the job was saved and requeued. Elsewhere the
    shell's convention, 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM."""
    return 0 if "SLURM_JOB_ID" in env else 128 + signum
