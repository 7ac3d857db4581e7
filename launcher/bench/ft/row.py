"""The fault tolerance row of python -m launcher.bench (`--ft` prints it alone): what replica groups cost when
nothing fails, and what a failure costs them against today's restart from a checkpoint.

The layout is two replica groups of one process (python -m launcher.ft, fault_tolerance.groups=2: a lighthouse
on loopback, torchft's all-reduce over gloo) against ddp x2 (torchrun, gloo) on the same recipe and global batch:
recipes/quickstart.yaml's MLP, 4 layers of each width of `--ft-widths`, AdamW, batch 64, one thread a process.
Every figure is read from what the runs write (metrics.jsonl: each log step's `time` and `train/samples_per_s`,
whose clock leaves checkpoint saves out; and their lines), not timed inside the loop:

- no failure: the steady step of each side (the batch over samples/s, per 10-step interval, after a quarter of
  the run), alternating fresh runs, the order reversed every repetition; ft / ddp per pair, its median and range.
  Beside it the CPU seconds a step of all of a side's processes (user and system, the slope between runs of N/4
  and N steps: start-up falls out): what fault tolerance adds in work, which a busy machine's wall clock, where
  the groups wait on each other and on other tenants, does not show apart from its waits.
- a failure: a process SIGKILLed in the forward of step k = `--ft-steps` (launcher/bench/ft/dying.py), a checkpoint
  every `--ft-every` steps, a log line every step. With fault tolerance, group 1 dies, is started again at once by
  this row (as a supervisor would) and copies group 0's state live; without it, ddp's rank 1 dies, torchrun stops
  the run, and the same command started again resumes the newest checkpoint. Both then train AFTER steps more and
  are stopped (SIGTERM). The stall runs from step k-1's line to the first step trained after the failure, the
  cost to step k+AFTER's (the run back where it was, and a few steps on), each beyond as many steady steps and
  the checkpoint saves in it left out: the wait for the quorum to drop the dead group (about timeouts.pg) against
  the restart (torchrun's stop, the processes started again, the checkpoint read) and the steps since that
  checkpoint trained again. The group started again: from its start to its first step with the other (its
  metrics.jsonl), of which the live copy (its log line `recovered live ... in N s`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from launcher.bench.ft.dying import VARIABLE
from launcher.bench.runs import PY, REPO

BATCH = 64
LAYERS = 4
AFTER = 5  # steps after a failure (and after a rejoin) that its cost is summed over
WAIT = 600  # seconds a run may take to reach a point this row waits for
TIMEOUTS = {"pg": 2, "quorum": 10, "join": 60}  # pg < quorum < join; pg is how long a dead group stalls the others
RECIPE = ["recipes/quickstart.yaml", "devices=cpu", f"data.batch_size={BATCH}", "data.val=null", "metrics={}",
          "trainer.eval_every=null", f"model.layers={LAYERS}", "step._target_=launcher.bench.ft.dying.step",
          "step._partial_=true", "logging.jsonl=true", "logging.tensorboard=false", "logging.progress_bar=false",
          "logging.memory_plan=false"]
GROUPS = ["fault_tolerance.groups=2", *(f"fault_tolerance.timeouts.{k}={v}" for k, v in TIMEOUTS.items())]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "launcher"]
# a step dropped in its all-reduce, or started again because its quorum (optimistic) came without the dead group
DROPPED = re.compile(r"^\[group 0\] fault tolerance: step (\d+) (?:dropped|started again)", re.M)
LONG = 10**6  # the failing runs' max_steps: they are stopped once their figures are written


def ft_options(parser) -> None:
    """This row's options, on python -m launcher.bench's parser."""
    parser.add_argument("--ft", dest="ft_only", action="store_true",
                        help="the fault tolerance row alone: replica groups against ddp x2, with no failure and with a "
                        "process killed mid-step, against restarting from a checkpoint")
    parser.add_argument("--ft-steps", type=int, default=150, help="its steps a run with no failure, and the step in "
                        "whose forward a process is killed (default 150)")
    parser.add_argument("--ft-every", type=int, default=40, help="its steps between checkpoints (default 40)")
    parser.add_argument("--ft-widths", type=_widths, default=[128, 1024],
                        help="its MLP widths, comma-separated (default 128,1024: 0.06M and 3.2M parameters)")


def _widths(text: str) -> List[int]:
    if not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", text):
        raise argparse.ArgumentTypeError(f"{text!r}: MLP widths are positive integers, comma-separated, e.g. 128,1024")
    return [int(w) for w in text.split(",")]


def ft(args) -> List[str]:
    if importlib.util.find_spec("torchft") is None:
        return ["fault tolerance row skipped: torchft is not installed (pip install -c constraints.txt -e '.[ft]')"]
    k, every = args.ft_steps, args.ft_every
    if not 0 < every < k:
        print(f"--ft-every {every}, --ft-steps {k}: the failure at step --ft-steps must come after a checkpoint, "
              f"so that a restart has one to resume: 0 < --ft-every < --ft-steps", file=sys.stderr)
        raise SystemExit(2)
    lines = [f"fault tolerance (torchft {importlib.metadata.version('torchft')}, gloo, lighthouse on loopback): 2 "
             f"replica groups of 1 process (python -m launcher.ft) against ddp x2 (torchrun), MLP 32-Wx{LAYERS}-10, "
             f"AdamW, global batch {BATCH}, 1 thread a process; timeouts pg {TIMEOUTS['pg']} s < quorum "
             f"{TIMEOUTS['quorum']} s < join {TIMEOUTS['join']} s",
             f"no failure: the steady step, {k} steps a run, {args.reps} alternating repetitions; cpu: the CPU "
             f"seconds a step of all the processes of a side (runs of {max(1, k // 4)} and {k} steps: the slope)",
             f"{'width':>6} {'parameters':>11} {'ddp x2':>9} {'ft 2x1':>9}  ft / ddp (range)  cpu ft / ddp (range)"]
    for width in args.ft_widths:
        side = _no_failure(args, width)
        r = [a / b for a, b in zip(side["ft"]["step"], side["ddp"]["step"])]
        c = [a / b for a, b in zip(side["ft"]["cpu"], side["ddp"]["cpu"])]
        lines.append(f"{width:>6} {_parameters(width) / 1e6:10.2f}M "
                     f"{statistics.median(side['ddp']['step']) * 1e3:7.2f}ms "
                     f"{statistics.median(side['ft']['step']) * 1e3:7.2f}ms  {statistics.median(r):.3f} "
                     f"({min(r):.3f}-{max(r):.3f})  {statistics.median(c):.3f} ({min(c):.3f}-{max(c):.3f})")
    lines += [f"a process SIGKILLed in the forward of step {k}, a checkpoint every {every} steps (a restart resumes "
              f"step {(k - 1) // every * every}), a log line every step; cost: from step {k - 1}'s line to step "
              f"{k + AFTER}'s, beyond as many steady steps",
              "stall: to training again; again: steps trained twice; short: steps trained by 1 group of 2; rejoin: the "
              "killed group started again, to its first step with the other; copy: of which the live copy (its log); "
              "serve: what the rejoin cost the live group",
              f"{'width':>6} {'side':<24} {'steady':>8} {'stall':>7} {'cost':>7} {'again':>5} {'short':>5} "
              f"{'rejoin':>7} {'copy':>6} {'serve':>6}"]
    for width in args.ft_widths:
        tolerant, restarted = _fault_tolerant(args, width), _restarted(args, width)
        lines.append(f"{width:>6} {'fault tolerance':<24} {tolerant['steady'] * 1e3:6.2f}ms {tolerant['stall']:6.2f}s "
                     f"{tolerant['cost']:6.2f}s {tolerant['again']:>5} {tolerant['short']:>5} "
                     f"{tolerant['rejoin']:6.2f}s {tolerant['copy']:5.2f}s {tolerant['serve']:5.2f}s")
        lines.append(f"{width:>6} {'restart from checkpoint':<24} {restarted['steady'] * 1e3:6.2f}ms "
                     f"{restarted['stall']:6.2f}s {restarted['cost']:6.2f}s {restarted['again']:>5} {0:>5} "
                     f"{'-':>7} {'-':>6} {'-':>6}")
    lines.append(f"command: python -m launcher.bench --ft --reps {args.reps} --ft-steps {k} --ft-every {every} "
                 f"--ft-widths {','.join(map(str, args.ft_widths))}")
    return lines


def _no_failure(args, width: int) -> Dict[str, Dict[str, List[float]]]:
    """Each side's steady step and CPU seconds a step, one of each a repetition, the sides alternating."""
    n, quarter = args.ft_steps, max(1, args.ft_steps // 4)

    def recipe(steps: int) -> List[str]:
        return [*RECIPE, f"model.hidden={width}", f"trainer.max_steps={steps}", "trainer.log_every=10",
                "checkpoint.every=null", "checkpoint.resume=never"]

    sides = {"ddp": lambda run, k: ([*TORCHRUN, *recipe(k), "strategy=ddp", f"run_dir={run}"], run),
             "ft": lambda run, k: ([PY, "-m", "launcher.ft", *recipe(k), *GROUPS, f"run_dir={run}"], run / "group_0")}
    measured: Dict[str, Dict[str, List[float]]] = {side: {"step": [], "cpu": []} for side in sides}
    for rep in range(args.reps):
        order = list(sides.items())
        for side, made in order if rep % 2 == 0 else reversed(order):
            cpu = {}
            for k in (quarter, n):
                command, folder = made(Path(args.run_dir) / f"ft-{width}-{side}-{rep}-{k}", k)
                cpu[k] = _cpu_seconds(command)
            measured[side]["step"].append(_steady(_rows(folder), n + 1))
            measured[side]["cpu"].append((cpu[n] - cpu[quarter]) / (n - quarter))
    return measured


def _cpu_seconds(command: List[str]) -> float:
    """A run to its end; the user and system CPU seconds of all its processes (each waited for by its parent)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    _finished(command, {})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _fault_tolerant(args, width: int) -> dict:
    """Group 1 killed at step k and started again at once: the live group's stall, the rejoin and its copy."""
    k, run = args.ft_steps, Path(args.run_dir) / f"ft-{width}-failure"
    command = [PY, "-m", "launcher.ft", *_failing(args, width), *GROUPS, f"run_dir={run}"]
    live = Watched(command, {VARIABLE: f"group1:{k}"})
    back = None
    try:
        lighthouse = live.wait_for(r"lighthouse at (\S+)").group(1)
        live.wait_for(r"group 1: killed by SIGKILL")
        started = time.time()
        back = Watched([*command, "fault_tolerance.group=1", f"fault_tolerance.lighthouse={lighthouse}",
                        "checkpoint.resume=never"], {})
        recovered = back.wait_for(r"recovered live from a live group at step (\d+) .* in (\d+\.\d+) s")
        joined = int(recovered.group(1))
        live.wait_for(rf"^\[group 0\] step {joined + 1 + AFTER}/")
    finally:
        for process in (back, live):
            if process is not None:
                process.stop()
    rows, theirs = _rows(run / "group_0"), _rows(run / "group_1")
    steady = _steady(rows, k)
    return {"steady": steady, "stall": _cost(rows, rows, k - 1, k, steady), "cost": _cost(rows, rows, k - 1, k + AFTER, steady),
            "again": sum(k <= int(n) <= joined + 1 + AFTER for n in DROPPED.findall(live.text())),
            "short": joined - k + 1, "rejoin": theirs[joined + 1]["time"] - started, "copy": float(recovered.group(2)),
            "serve": _cost(rows, rows, joined, joined + 1 + AFTER, steady)}


def _restarted(args, width: int) -> dict:
    """ddp's rank 1 killed at step k; the same command again resumes the newest checkpoint."""
    k, run = args.ft_steps, Path(args.run_dir) / f"ft-{width}-restart"
    command = [*TORCHRUN, *_failing(args, width), "strategy=ddp", f"run_dir={run}"]
    code = _finished(command, {VARIABLE: f"rank1:{k}"}, failing=True)
    if code == 0:
        raise SystemExit(f"benchmark run did not fail at step {k} as asked: {' '.join(command)}")
    before = _rows(run)
    again = Watched(command, {})
    try:
        resumed = int(again.wait_for(r"^resumed from \S+ \(step (\d+),").group(1))
        again.wait_for(rf"^step {k + AFTER}/")
    finally:
        again.stop()
    after = {step: row for step, row in _rows(run).items() if step > resumed}
    steady = _steady(before, k)
    return {"steady": steady, "stall": _cost(before, after, k - 1, resumed + 1, steady, progress=1),
            "cost": _cost(before, after, k - 1, k + AFTER, steady), "again": k - resumed}


def _failing(args, width: int) -> List[str]:
    return [*RECIPE, f"model.hidden={width}", f"trainer.max_steps={LONG}", "trainer.log_every=1",
            f"checkpoint.every={args.ft_every}"]


def _cost(first: dict, then: dict, a: int, b: int, steady: float, progress: Optional[int] = None) -> float:
    """Seconds from the line of step `a` (in `first`) to that of step `b` (in `then`) beyond `progress` steady steps
    (by default b - a: the steps gained), the saves of the steps after `a` in `then` left out."""
    saves = sum(row.get("checkpoint/blocked_s", 0.0) for step, row in then.items() if a < step <= b)
    return then[b]["time"] - first[a]["time"] - (b - a if progress is None else progress) * steady - saves


def _steady(rows: dict, before: int) -> float:
    """The median step (seconds) of the log intervals before step `before`, after a quarter of them."""
    steps = [BATCH / row["train/samples_per_s"] for step, row in sorted(rows.items()) if step < before]
    return statistics.median(steps[len(steps) // 4:])


def _rows(folder: Path) -> Dict[int, dict]:
    """A run's metrics.jsonl, by step."""
    return {row["step"]: row for row in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}


def _parameters(width: int) -> int:
    return 32 * width + (LAYERS - 1) * width * width + 10 * width + LAYERS * width + 10


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _finished(command: List[str], extra: dict, failing: bool = False) -> int:
    """A run to its end; its exit code (a failure is the bench's, unless the run was to fail)."""
    done = subprocess.run(command, cwd=REPO, env=_env(extra), capture_output=True, text=True, timeout=WAIT)
    if done.returncode != 0 and not failing:
        raise SystemExit(f"benchmark run failed (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    return done.returncode


class Watched:
    """A run in the background, its lines (stdout and stderr) collected as they come."""

    def __init__(self, command: List[str], extra: dict):
        self.command = command
        self.process = subprocess.Popen(command, cwd=REPO, env=_env(extra), text=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)
        self.lines: List[str] = []
        self.reading = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reading.start()

    def wait_for(self, pattern: str) -> re.Match:
        deadline, seen = time.monotonic() + WAIT, 0
        while time.monotonic() < deadline:
            lines = list(self.lines)
            for line in lines[seen:]:
                found = re.search(pattern, line)
                if found:
                    return found
            seen = len(lines)
            if self.process.poll() is not None and not self.reading.is_alive() and len(self.lines) == seen:
                break
            time.sleep(0.05)
        raise SystemExit(f"benchmark run never printed /{pattern}/ (exit {self.process.poll()}): "
                         f"{' '.join(self.command)}\n{self.text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM (each process saves and stops), then SIGKILL if it has not within a minute."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reading.join(timeout=10)

    def text(self) -> str:
        return "".join(self.lines)
