"""The reference workload of shared/bench: MLP 32-128-128-10, Adam, global batch 64, an in-memory
TensorDataset, one thread. Both sides of the benchmark build it from here, and both time their
steps with `StepClock`."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from typing import Optional

import torch
from torch import nn

N, D, C, WIDTH = 8192, 32, 10, 128


def make_data(seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w = torch.randn(D, C, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ w).argmax(1))


def make_model(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(nn.Linear(D, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, C))


class StepClock:
    """Ends of steps on the host clock; the report is one JSON line on stdout."""

    def __init__(self):
        self.ends: list[float] = []
        self.cpu: list[float] = []  # the process's CPU seconds at each end: what a busy machine's load moves less
        self.first_wall = None

    def tick(self) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if self.first_wall is None:
            self.first_wall = time.time()

    def report(self, **extra) -> None:
        durations = [b - a for a, b in zip(self.ends, self.ends[1:])]
        warm = min(50, len(durations) // 2)  # after a warm-up of 50 steps (or half)
        durations, cpu = durations[warm:], [b - a for a, b in zip(self.cpu, self.cpu[1:])][warm:]
        t0 = float(os.environ.get("BENCH_T0", "0")) or None
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # a run on the GPU: its peak allocated
            extra = {"max_memory_gib": torch.cuda.max_memory_allocated() / 2**30, **extra}
        print("BENCH " + json.dumps({
            # (a one-step run, the start-up row's, has no step between two ends to time)
            "median_step_us": statistics.median(durations) * 1e6 if durations else None,
            "mean_step_us": statistics.fmean(durations) * 1e6 if durations else None,  # log steps' cost spread over all
            "median_step_cpu_us": statistics.median(cpu) * 1e6 if cpu else None,
            "first_step_s": self.first_wall - t0 if t0 else None,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "steps": len(self.ends), **extra}), flush=True)


def finish(code: Optional[int] = 0):
    """The end of a side's process. A run that `runs.measure` started (BENCH_T0 set: its figures are its BENCH line,
    printed by now) leaves at once, without the interpreter's teardown (about a CPU second of torch's modules freed,
    which no figure includes); any other run (the start-up row times whole processes) exits as usual."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("BENCH_T0"):
        os._exit(code or 0)
    sys.exit(code)


def trainer_callback(clock: StepClock, logged: Optional[dict] = None):
    """A transformers Trainer callback for a peer: every step's end on `clock` (the other sides' clock), and
    into `logged["loss"]` the last loss Trainer logs (the mean over the steps since the log before, as the
    launcher logs it)."""
    from transformers import TrainerCallback

    class Timed(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logged is not None and logs and "loss" in logs:
                logged["loss"] = logs["loss"]

    return Timed()
