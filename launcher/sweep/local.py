"""A sweep's runs on this machine: one after another, or `--parallel N` at once, each `python -m launcher` in a
process (and a session) of its own. With GPUs, each run gets devices of its own (`--gpus-per-run`, 1 by
default), the least used first, and no two runs share one. A run whose folder says it is done is skipped;
one that stopped resumes (its recipe's checkpoint.resume=auto). Ctrl-C or SIGTERM reaches every running
run once: each saves at its next step and stops, and the same command later resumes them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

from launcher.errors import UserError
from launcher.sweep import folder
from launcher.sweep.folder import Sweep
from launcher.sweep.grid import Run

POLL = 0.2  # seconds between looks at the running processes


def gpu_groups(per_run: int, parallel: int, share: bool) -> List[Optional[str]]:
    """The `devices` of each slot of the queue (None: the recipe's own, on a machine without GPUs)."""
    ids = _visible_gpus()
    if not ids:
        return [None] * parallel
    groups = [ids[i:i + per_run] for i in range(0, len(ids) - per_run + 1, per_run)]
    if not groups:
        raise UserError(f"--gpus-per-run {per_run}: this machine shows {len(ids)} GPU(s)")
    if parallel > len(groups) and not share:
        raise UserError(f"--parallel {parallel}: {len(ids)} GPU(s) hold {len(groups)} run(s) of {per_run} at once; "
                        f"use --parallel {len(groups)}, or --share-gpus to put several runs on one GPU")
    return [f"[{','.join(map(str, groups[i % len(groups)]))}]" for i in range(parallel)]


def _visible_gpus() -> List[int]:
    """Physical GPU ids this process may use (CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(v) for v in visible.split(",") if v.strip().isdigit()]
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [line.split(",") for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []
    return [int(index) for index, _ in sorted(rows, key=lambda r: int(r[1]))]  # the least used first


def run_all(sweep: Sweep, command: Callable[[Run], List[str]], slots: List[Optional[str]],
            say: Callable[[str], None]) -> int:
    """Every run not done yet; returns 0 when all are done, 1 when any failed, 128 + N when a signal stopped it."""
    todo = [r for r in sweep.runs if folder.status(sweep.run_dir(r)).state != "done"]
    say(f"sweep: {len(sweep.runs)} runs in {sweep.folder}, {len(sweep.runs) - len(todo)} done already; "
        f"{len(slots)} at a time")
    running: Dict[subprocess.Popen, tuple] = {}
    free = list(slots)
    stopping: List[int] = []
    signalled: set = set()  # the processes passed the signal: once each
    previous = {s: signal.signal(s, lambda n, _: stopping.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    failed = 0
    try:
        while (todo and not stopping) or running:
            while todo and free and not stopping:
                run, devices = todo.pop(0), free.pop(0)
                running[_start(sweep, run, command(run), devices, len(slots))] = (run, devices, time.time())
                say(f"sweep: {run.name} started" + (f" on devices {devices}" if devices else ""))
            if stopping:
                _forward(running, stopping[0], signalled)
            for proc in [p for p in running if p.poll() is not None]:
                run, devices, started = running.pop(proc)
                folder.mark_exit(sweep.run_dir(run), proc.returncode, started)
                free.append(devices)
                state = folder.status(sweep.run_dir(run))
                failed += state.state == "failed"
                say(f"sweep: {run.name} {state.describe()} after {time.time() - started:.0f}s"
                    + (f"; its output: {sweep.run_dir(run) / 'output.log'}" if state.state == "failed" and len(slots) > 1 else ""))
            time.sleep(POLL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping:
        say(f"sweep: stopped by {signal.Signals(stopping[0]).name}; the same command resumes the runs")
        return 128 + stopping[0]
    return 1 if failed else 0


def _start(sweep: Sweep, run: Run, argv: List[str], devices: Optional[str], slots: int) -> subprocess.Popen:
    quiet = slots > 1
    run_dir = sweep.run_dir(run)
    run_dir.mkdir(parents=True, exist_ok=True)
    if devices:
        argv = [*argv, f"devices={devices}"]
    output = open(run_dir / "output.log", "ab") if quiet else None  # several at once: each its own file
    env = dict(os.environ)
    if quiet and not devices and "OMP_NUM_THREADS" not in env:
        # several runs on the CPU share its cores (as torchrun shares them among its workers): each run's
        # threads spinning on every core would slow them all several times over
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // slots))
    try:
        # a session of its own: a terminal's Ctrl-C reaches the sweep alone, which passes one signal on
        return subprocess.Popen([sys.executable, "-m", "launcher", *argv], stdout=output, stderr=output,
                                start_new_session=True, env=env)
    finally:
        if output is not None:
            output.close()


def _forward(running: Dict[subprocess.Popen, tuple], signum: int, signalled: set) -> None:
    for proc in running:
        if proc not in signalled and proc.poll() is None:
            proc.send_signal(signum)
            signalled.add(proc)
