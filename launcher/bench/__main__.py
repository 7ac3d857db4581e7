"""python -m launcher.bench [--steps 2000] [--reps 5] [--no-ddp] [--no-peers] [--no-scaling]

The reference workload of shared/bench (MLP 32-128-128-10, Adam, batch 64, in-memory data, one thread
per process) run through recipes/bench.yaml and through a hand-written loop (launcher/bench/raw.py),
alternating, each run in a fresh process, for one process and for DDP with 2 processes (torchrun,
gloo). Every side times its steps the same way (launcher/bench/workload.py).

Per configuration it prints the median per-step time of each side, and their ratio as the median
over repetitions of (ours / raw) of runs made next to each other, with its range; the same ratio
when the launcher fetches the data item by item as the hand-written loop does (`per-item`: the
loop's own cost, without the gain of batched fetching); seconds from process start to the end of the
first step, and peak RSS of rank 0. Accelerate and Lightning (launcher/bench/peer_*.py) run as peers
when installed. Then scaling: a compute-bound size of the workload from 1 to 2 DDP processes, as
efficiency (samples/s with 2 / twice samples/s with 1), for both loops, both fetching item by item.

Machines are noisy: compare ratios measured in one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import importlib.util
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
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
SCALING = {"batch": 1024, "width": 1024}  # compute-bound: the step is matmuls, not Python


# torch 2.13's gloo sometimes aborts a process at exit, after destroy_process_group, with this line
# (seen in the hand-written DDP loop too). The run's figures were printed before it: they count.
ABORT_AT_EXIT = "terminate called without an active exception"
aborted_at_exit: list[str] = []


def measure(command: list[str], env: dict) -> dict | None:
    """One fresh run; its BENCH line, or None when a peer's library is missing."""
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


def workload(args) -> list[str]:
    steps = str(args.steps)
    recipe = ["recipes/bench.yaml", f"trainer.max_steps={steps}", "run_dir=/tmp/launcher-bench"]
    installed = {"accelerate": ("accelerate",), "lightning": ("lightning", "pytorch_lightning")}
    peers = [p for p, names in installed.items() if args.peers and any(importlib.util.find_spec(n) for n in names)]
    configs = [("1 process", [])] + ([("DDP x2 (gloo)", TORCHRUN)] if args.ddp else [])
    lines = [f"reference workload, {steps} steps, {args.reps} alternating repetitions "
             f"(python -m launcher.bench --steps {steps} --reps {args.reps})",
             f"{'':14} {'step raw':>9} {'ours':>7}  {'ratio (range)':<19} {'per-item':>8}  "
             f"{'1st step raw':>12} {'ours':>5} {'+':>6}  {'RSS raw':>8} {'ours':>7} {'+':>6}"]
    for name, launch in configs:
        sides = {"raw": ([*(launch or [PY]), "-m", "launcher.bench.raw", steps], {}),
                 "ours": ([*(launch or [PY]), "-m", "launcher.bench.child", *recipe], {}),
                 "per-item": ([*(launch or [PY]), "-m", "launcher.bench.child", *recipe], {"BENCH_FETCH": "per-item"})}
        for peer in peers:
            sides[peer] = ([*(launch or [PY]), "-m", f"launcher.bench.peer_{peer}", steps], {})
        res = alternate(sides, args.reps)
        (r, lo, hi), per_item = ratio(res, "ours"), ratio(res, "per-item")[0]
        first = {k: median(res[k], "first_step_s") for k in ("raw", "ours")}
        rss = {k: median(res[k], "peak_rss_mib") for k in ("raw", "ours")}
        lines.append(f"{name:14} {median(res['raw'], 'median_step_us'):7.0f}us {median(res['ours'], 'median_step_us'):5.0f}us"
                     f"  {r:5.3f} ({lo:.3f}-{hi:.3f})  {per_item:8.3f}  {first['raw']:11.2f}s {first['ours']:4.2f}s "
                     f"{first['ours'] - first['raw']:+5.2f}s  {rss['raw']:5.0f}MiB {rss['ours']:4.0f}MiB "
                     f"{rss['ours'] - rss['raw']:+4.0f}MiB")
        for peer in peers:
            if peer in res:
                p, plo, phi = ratio(res, peer)
                lines.append(f"{'':14} peer {peer}: {median(res[peer], 'median_step_us'):.0f}us per step, "
                             f"ratio to raw {p:.3f} ({plo:.3f}-{phi:.3f})")
    return lines


def scaling(args) -> list[str]:
    steps, batch, width = str(args.scaling_steps), str(SCALING["batch"]), str(SCALING["width"])
    recipe = ["recipes/bench.yaml", f"trainer.max_steps={steps}", f"data.batch_size={batch}",
              f"model.width={width}", "run_dir=/tmp/launcher-bench"]
    sides = {"raw": ([PY, "-m", "launcher.bench.raw", steps, batch, width], {}),
             "raw x2": ([*TORCHRUN, "-m", "launcher.bench.raw", steps, batch, width], {}),
             "ours": ([PY, "-m", "launcher.bench.child", *recipe], {"BENCH_FETCH": "per-item"}),
             "ours x2": ([*TORCHRUN, "-m", "launcher.bench.child", *recipe], {"BENCH_FETCH": "per-item"})}
    res = alternate(sides, args.reps)
    eff = {}
    for name in ("raw", "ours"):
        pairs = zip(res[name], res[f"{name} x2"])
        eff[name] = statistics.median(one["median_step_us"] / (2 * two["median_step_us"]) for one, two in pairs)
    return [f"scaling, compute-bound (MLP width {width}, global batch {batch}, {steps} steps, {args.reps} repetitions): "
            f"DDP 1 -> 2 processes; both fetch item by item, so that they do the same work",
            f"{'':14} {'1 process':>10} {'2 processes':>12} {'efficiency':>11}"] + [
            f"{name:14} {median(res[name], 'median_step_us') / 1e3:8.1f}ms {median(res[name + ' x2'], 'median_step_us') / 1e3:10.1f}ms "
            f"{eff[name]:11.3f}" for name in ("raw", "ours")] + [
            f"{'ours / raw':14} {'':23} {eff['ours'] / eff['raw']:11.3f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--scaling-steps", type=int, default=100)
    parser.add_argument("--no-ddp", dest="ddp", action="store_false")
    parser.add_argument("--no-peers", dest="peers", action="store_false")
    parser.add_argument("--no-scaling", dest="scaling", action="store_false")
    args = parser.parse_args()
    print("\n".join(workload(args)), flush=True)
    if args.scaling:
        print("\n".join(scaling(args)))
    if aborted_at_exit:
        print(f"({len(aborted_at_exit)} runs aborted in gloo at exit, after printing their figures: "
              f"{'; '.join(aborted_at_exit)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
