"""Kill a training run at a chosen instant inside checkpoint saving, then check that resume is exact.

    python -m tests.save_crash --trials 20          # the stress run: random instants, seed printed

`python -m tests.save_crash --kill-at K -- ARGS` trains `python -m launcher ARGS` and SIGKILLs itself
at the K-th file-system event of checkpoint saving: every chunk torch.save writes, every fsync,
rename and deletion. Events are counted across all saves of the run.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = ["recipes/quickstart.yaml", "data.train.n=1024", "data.val=null", "data.batch_size=32", "trainer.max_steps=40",
          "trainer.log_every=10", "checkpoint.every=5", "checkpoint.keep=2", "logging.tensorboard=false"]


def _instrumented(kill_at: int) -> None:
    """Count every file-system event of checkpoint saving in this process; the kill_at-th kills it.
    (This process only trains, so patching os, shutil and Path here patches the saves alone.)"""
    import atexit

    import launcher.checkpoint as ck

    events = {"n": 0}

    def tick() -> None:
        events["n"] += 1
        if events["n"] == kill_at:
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

    write = ck._write
    ck._write = lambda path, fn, atomic=False: write(path, lambda f: fn(Ticking(f)), atomic)
    os.replace, os.fsync, shutil.rmtree, Path.rename = (counted(f) for f in (os.replace, os.fsync, shutil.rmtree, Path.rename))
    atexit.register(lambda: print(f"save_crash: events={events['n']}", file=sys.stderr))


def run(run_dir: Path, kill_at: int = 0, extra: list = ()) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tests.save_crash", "--kill-at", str(kill_at), "--", *RECIPE, *extra,
               f"run_dir={run_dir}"]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def count_events(folder: Path) -> int:
    done = run(folder / "count")
    assert done.returncode == 0, done.stderr
    return int(done.stderr.rsplit("save_crash: events=", 1)[1].split()[0])


def trial(folder: Path, kill_at: int, reference: Path) -> str:
    """Kill at `kill_at`, check the folder, resume, and compare with `reference`. Returns a summary."""
    run_dir = folder / f"kill_{kill_at}"
    killed = run(run_dir, kill_at)
    assert killed.returncode == -signal.SIGKILL, f"expected a kill at event {kill_at}: {killed.stderr[-2000:]}"
    from launcher.checkpoint import choose, is_complete

    steps = sorted((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else []
    assert all(is_complete(s) for s in steps), f"a step_* folder is incomplete after a kill at event {kill_at}"
    newest, _ = choose(run_dir / "checkpoints", "auto")
    resumed = run(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    if newest is not None:
        assert f"resumed from {newest}" in resumed.stdout
    final = torch.load(run_dir / "model.pt", weights_only=True)
    expected = torch.load(reference, weights_only=True)
    assert all(torch.equal(final[k], expected[k]) for k in expected), f"resume after a kill at {kill_at} is not exact"
    return f"kill at event {kill_at}: resumed from {newest.name if newest else 'scratch'}, exact"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("args", nargs="*")
    args = parser.parse_args()
    if args.kill_at is not None:
        _instrumented(args.kill_at)  # 0: count only
        from launcher.cli import main as launcher_main

        return launcher_main(args.args)
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    folder = Path(tempfile.mkdtemp(prefix="save_crash_"))
    reference = run(folder / "reference")
    assert reference.returncode == 0, reference.stderr
    total = count_events(folder)
    picks = random.Random(seed).sample(range(1, total + 1), min(args.trials, total))
    print(f"seed {seed}: {total} file-system events in the saves of one run; {len(picks)} trials")
    for k in picks:
        print(trial(folder, k, folder / "reference" / "model.pt"), flush=True)
    print(f"{len(picks)} passed, 0 failed")
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
