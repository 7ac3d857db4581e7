"""Kill a training run at a chosen instant inside checkpoint saving, then check that resume is exact.

    python -m tests.save_crash --trials 20                  # the stress run: random instants, seed printed
    python -m tests.save_crash --trials 20 --fsdp           # fsdp x2: sharded checkpoints, each rank's shards
    python -m tests.save_crash --trials 20 --fsdp --async   # ... written in the background
    python -m tests.save_crash --trials 20 --async          # one process, rank 0's writer thread

`python -m tests.save_crash --kill-at K -- ARGS` trains `python -m launcher ARGS` and SIGKILLs itself
at the K-th file-system event of checkpoint saving: every chunk torch.save writes, every item DCP
writes into a shard, every fsync, rename and deletion. Events are counted across all saves of the run.
With --fsdp it runs under torchrun with 2 processes, every rank instrumented, and rank --kill-rank
kills itself at its K-th event (under --async, on the thread that writes the shards when that is
where the event falls); torchrun then ends the other rank.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = ["recipes/quickstart.yaml", "data.train.n=1024", "data.val=null", "data.batch_size=32", "trainer.max_steps=40",
          "trainer.log_every=10", "checkpoint.every=5", "checkpoint.keep=2", "logging.tensorboard=false",
          "logging.memory_plan=false"]


def _instrumented(kill_at: int, kill_rank: int) -> None:
    """Count every file-system event of checkpoint saving in this process; the kill_at-th kills it.
    (This process only trains, so patching os, shutil and Path here patches the saves alone.)"""
    import atexit

    import launcher.checkpoint.files as ck

    events = {"n": 0}

    def tick() -> None:
        events["n"] += 1
        if events["n"] == kill_at and os.environ.get("RANK", "0") == str(kill_rank):
            print("save_crash: killed", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(fn):
        def wrapper(*args, **kwargs):
            tick()
            result = fn(*args, **kwargs)
            tick()
            return result
        return wrapper

    class Ticking:  # the file torch.save writes into: every chunk is an event
        def __init__(self, f):
            self.f = f

        def write(self, data):
            tick()
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    write = ck.write
    ck.write = lambda path, fn, atomic=False: write(path, lambda f: fn(Ticking(f)), atomic)
    os.replace, os.fsync, shutil.rmtree, Path.rename = (counted(f) for f in (os.replace, os.fsync, shutil.rmtree, Path.rename))
    import torch.distributed.checkpoint.filesystem as dcp_files

    dcp_files._write_item = counted(dcp_files._write_item)  # each tensor or object written into a shard
    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: print(f"save_crash: rank {rank} events={events['n']}", file=sys.stderr))


SHARDED = ["strategy=fsdp"]
ASYNC = ["checkpoint.async_save=true"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def run(run_dir: Path, kill_at: int = 0, extra: list = (), kill_rank: int = 0) -> subprocess.CompletedProcess:
    """One run of the recipe (under torchrun when `extra` asks for fsdp), killed at `kill_at` (0: never)."""
    from tests.pace import paced

    sharded = "strategy=fsdp" in extra
    prefix = [*TORCHRUN, "-m"] if sharded else [sys.executable, "-m"]
    command = [*prefix, "tests.save_crash", "--kill-at", str(kill_at), "--kill-rank", str(kill_rank), "--", *RECIPE,
               *extra, f"run_dir={run_dir}"]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=paced(300),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def reference(folder: Path, extra: list = ()) -> dict:
    """The whole run, in `folder`/reference, and how many file-system events each rank's saves made in it."""
    done = run(folder / "reference", extra=extra)
    assert done.returncode == 0, done.stderr
    return {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"save_crash: rank (\d+) events=(\d+)", done.stderr)}


def killed(folder: Path, kill_at: int, extra: list = (), kill_rank: int = 0) -> tuple:
    """Kill rank `kill_rank` (a real process SIGKILLing itself) at its event `kill_at`, and check that every step_*
    left is complete: (the run folder, the newest complete checkpoint, which a resume must name, or None)."""
    run_dir = folder / f"kill_{kill_rank}_{kill_at}"
    done = run(run_dir, kill_at, extra, kill_rank)
    expected = -signal.SIGKILL if "strategy=fsdp" not in extra else 1  # torchrun's own code when a worker dies
    assert done.returncode == expected and "save_crash: killed" in done.stderr, \
        f"expected a kill at event {kill_at}: {done.stderr[-2000:]}"
    from launcher.checkpoint import choose, is_complete

    steps = sorted((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else []
    assert all(is_complete(s) for s in steps), f"a step_* folder is incomplete after a kill at event {kill_at}"
    return run_dir, choose(run_dir / "checkpoints", "auto")[0]


def trial(folder: Path, kill_at: int, reference: Path, extra: list = (), kill_rank: int = 0) -> str:
    """Kill rank `kill_rank` at its event `kill_at`, check the folder, resume, and compare with `reference`.
    Returns a summary."""
    run_dir, newest = killed(folder, kill_at, extra, kill_rank)
    resumed = run(run_dir, extra=extra)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    if newest is not None:
        assert f"resumed from {newest}" in resumed.stdout
    final = torch.load(run_dir / "model.pt", weights_only=True)
    expected = torch.load(reference, weights_only=True)
    assert all(torch.equal(final[k], expected[k]) for k in expected), f"resume after a kill at {kill_at} is not exact"
    return f"kill of rank {kill_rank} at event {kill_at}: resumed from {newest.name if newest else 'scratch'}, exact"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--fsdp", action="store_true", help="fsdp x2 under torchrun: sharded checkpoints")
    parser.add_argument("--async", dest="background", action="store_true", help="checkpoint.async_save: saves written "
                        "on a thread (rank 0's writer of the full format, DCP's of the shards)")
    parser.add_argument("args", nargs="*")
    args = parser.parse_args()
    if args.kill_at is not None:
        _instrumented(args.kill_at, args.kill_rank)  # 0: count only
        from launcher.cli import main as launcher_main

        return launcher_main(args.args)
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    extra = (SHARDED if args.fsdp else []) + (ASYNC if args.background else [])
    folder = Path(tempfile.mkdtemp(prefix="save_crash_"))
    ranks = [0, 1] if args.fsdp else [0]
    totals = reference(folder, extra)
    rng = random.Random(seed)  # the trials split evenly over the ranks, each rank's instants without repeats
    share = [args.trials // len(ranks) + (i < args.trials % len(ranks)) for i in range(len(ranks))]
    picks = [(rank, k) for rank, n in zip(ranks, share) for k in rng.sample(range(1, totals[rank] + 1), min(n, totals[rank]))]
    print(f"seed {seed}: {totals} file-system events per rank in the saves of one run {' '.join(extra)}; "
          f"{len(picks)} trials")
    for rank, k in picks:
        print(trial(folder, k, folder / "reference" / "model.pt", extra, rank), flush=True)
    print(f"{len(picks)} passed, 0 failed")
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
