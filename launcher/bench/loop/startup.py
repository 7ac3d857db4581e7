"""The start-up row of python -m launcher.bench: a one-step run through the command line, as a user types
it, TensorBoard off and on, against the hand-written loop's one step, as whole processes timed from
start to exit, alternating."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from launcher.bench import runs

REPO = Path(__file__).resolve().parents[3]
PY = sys.executable


def _wall(command: list[str]) -> float:
    """Seconds from the start of a fresh process to its exit."""
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"benchmark run failed (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    return time.perf_counter() - began


def startup(args) -> list[str]:
    """The row's lines: the median seconds of each side, and of ours / raw over pairs run side by side."""
    recipe = [PY, "-m", "launcher", "recipes/bench.yaml", "trainer.max_steps=1"]
    sides = {"raw": lambda i: [PY, "-m", "launcher.bench.loop.raw", "1"],
             "off": lambda i: [*recipe, f"run_dir={args.run_dir}/startup/off{i}"],
             "on": lambda i: [*recipe, "logging.tensorboard=true", f"run_dir={args.run_dir}/startup/on{i}"]}
    if not runs.made:  # once first, unless an earlier row's runs did: the files it reads are in the page cache for
        _wall(sides["off"](-1))  # every side alike
    times: dict = {name: [] for name in sides}
    for rep in range(args.startup_reps):
        order = list(sides.items())
        for name, command in order if rep % 2 == 0 else reversed(order):
            times[name].append(_wall(command(rep)))
    out = [f"start-up: a one-step run, whole processes, {args.startup_reps} alternating repetitions "
           f"(python -m launcher.bench --startup --startup-reps {args.startup_reps})",
           f"{'':24} {'seconds':>8} {'ratio to raw (range)':<22}",
           f"{'hand-written loop':24} {statistics.median(times['raw']):8.2f}"]
    for name, label in (("off", "launcher, TensorBoard off"), ("on", "launcher, TensorBoard on")):
        r = [ours / raw for ours, raw in zip(times[name], times["raw"])]
        out.append(f"{label:24} {statistics.median(times[name]):8.2f} {statistics.median(r):5.3f} "
                   f"({min(r):.3f}-{max(r):.3f})")
    return out
