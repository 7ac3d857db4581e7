"""python -m launcher.bench [--steps 2000] [--reps 5] [--no-ddp]

The reference workload of shared/bench run through recipes/bench.yaml and through a hand-written
loop (launcher/bench/raw.py), alternating, each run in a fresh process, for one process and for DDP
with 2 processes (torchrun, gloo). Both time their steps the same way (launcher/bench/workload.py).
Prints, per configuration, the medians over repetitions of: median per-step time, seconds from process
start to the end of the first step, and peak RSS of rank 0; and the ratios. Machines are noisy:
compare ratios measured in one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def measure(command: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_T0": repr(time.time())}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lines = [l for l in done.stdout.splitlines() if l.startswith("BENCH ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"benchmark run failed: {' '.join(command)}\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][6:])


def configurations(steps: int, ddp: bool, run_dir: str) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    recipe = ["recipes/bench.yaml", f"trainer.max_steps={steps}", f"run_dir={run_dir}"]
    out = {"1 process": ([sys.executable, "-m", "launcher.bench.raw", str(steps)],
                         [sys.executable, "-m", "launcher.bench.child", *recipe])}
    if ddp:
        out["DDP x2 (gloo)"] = ([*torchrun, "-m", "launcher.bench.raw", str(steps)],
                                [*torchrun, "-m", "launcher.bench.child", *recipe])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-ddp", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, (raw, ours) in configurations(args.steps, not args.no_ddp, "/tmp/launcher-bench").items():
        results = {"raw": [], "launcher": []}
        for rep in range(args.reps):
            order = [("raw", raw), ("launcher", ours)] if rep % 2 == 0 else [("launcher", ours), ("raw", raw)]
            for kind, command in order:
                results[kind].append(measure(command))
        med = {kind: {key: statistics.median(r[key] for r in runs) for key in
                      ("median_step_us", "first_step_s", "peak_rss_mib")} for kind, runs in results.items()}
        rows.append((name, med["raw"], med["launcher"]))
    print(f"reference workload, {args.steps} steps, medians of {args.reps} alternating repetitions "
          f"(python -m launcher.bench --steps {args.steps} --reps {args.reps})")
    print(f"{'':16} {'step raw':>10} {'step ours':>10} {'ratio':>6} {'1st step raw':>13} {'ours':>6} {'+':>6} "
          f"{'RSS raw':>9} {'ours':>7} {'+':>6}")
    for name, raw, ours in rows:
        print(f"{name:16} {raw['median_step_us']:8.0f}us {ours['median_step_us']:8.0f}us "
              f"{ours['median_step_us'] / raw['median_step_us']:6.3f} {raw['first_step_s']:12.2f}s "
              f"{ours['first_step_s']:5.2f}s {ours['first_step_s'] - raw['first_step_s']:+5.2f}s "
              f"{raw['peak_rss_mib']:6.0f}MiB {ours['peak_rss_mib']:4.0f}MiB {ours['peak_rss_mib'] - raw['peak_rss_mib']:+4.0f}MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
