"""Running the benchmark's sides: each run a fresh process whose BENCH line is its figures, sides alternated
so that drift hits all alike, and ratios summarised over repetitions of runs made next to each other."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP = 3  # a peer's exit code when its library is not installed
PY = sys.executable


# torch 2.13's gloo sometimes aborts a process at exit, after destroy_process_group, with this line
# (seen in the hand-written DDP loop too). The run's figures were printed before it: they count.
ABORT_AT_EXIT = "terminate called without an active exception"
aborted_at_exit: list[str] = []
made = 0  # runs this process has started: where one has, the files a run reads are in the page cache


def measure(command: list[str], env: dict) -> dict | None:
    """One fresh run; its BENCH line, or None when a peer's library is missing."""
    global made
    made += 1
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_T0": repr(time.time()), **env}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lines = [l for l in done.stdout.splitlines() if l.startswith("BENCH ")]
    if done.returncode == SKIP:
        return None
    if lines and done.returncode != 0 and ABORT_AT_EXIT in done.stderr:
        aborted_at_exit.append(" ".join(command[-4:]))
    elif done.returncode != 0 or not lines:
        raise SystemExit(f"benchmark run failed (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][6:])


def alternate(sides: dict, reps: int) -> dict:
    """Each side `reps` times, in an order that reverses every repetition, so drift hits all alike."""
    results = {name: [] for name in sides}
    for rep in range(reps):
        order = list(sides.items())
        for name, (command, env) in order if rep % 2 == 0 else reversed(order):
            results[name].append(measure(command, env))
    return {name: runs for name, runs in results.items() if None not in runs}


def ratio(results: dict, side: str, key: str = "median_step_us") -> tuple[float, float, float]:
    """Median, min and max over repetitions of side / raw, each pair measured next to each other."""
    r = [a[key] / b[key] for a, b in zip(results[side], results["raw"])]
    return statistics.median(r), min(r), max(r)


def median(runs: list, key: str) -> float:
    return statistics.median(run[key] for run in runs)
