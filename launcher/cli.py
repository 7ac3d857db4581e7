"""The command line: parse, load the recipe, hand off to training, turn outcomes into exit codes.

    0       done (under Slurm, after a signal too: saved and requeued)
    1       a bug or a crash: Python's traceback (an uncaught exception)
    2       a user mistake (recipe, command line, environment, checkpoint): one line per problem, no traceback
    3       the loss became NaN or infinite: the step is named, nothing is saved after it
    4       Slurm refused the requeue after a signal; the checkpoint is saved
    5       out of memory: the step, the peak and the memory snapshot (when one was asked for) are named
    6       a collective did not finish within dist_timeout: each rank names the step and what it waited in
    128+N   stopped by signal N (130 Ctrl-C, 143 SIGTERM); the checkpoint is saved
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional

from launcher.errors import (EXIT_BUG, EXIT_DIVERGED, EXIT_HUNG, EXIT_OOM, EXIT_REQUEUE, EXIT_USER, Hung, OutOfMemory,
                             PeerFailed, TrainingDiverged, UserError)
from launcher.stopping import RequeueFailed, Stopped, exit_code

USAGE = "python -m launcher RECIPE.yaml [key=value ...] [--print-config]"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        _report(UserError(f"{message} (usage: {USAGE})"))
        raise SystemExit(EXIT_USER)


EPILOG = """commands (each takes --help):
  python -m launcher RECIPE [key=value ...]         train (torchrun, accelerate launch and srun start this too)
  python -m launcher.slurm submit|render RECIPE ... an sbatch job of the recipe, requeued after preemption
  python -m launcher.export CHECKPOINT OUT          a checkpoint (any strategy) as one plain model file
  python -m launcher.bench                          the launcher against a hand-written loop (CPU)
  python -m launcher.bench.gpu                      the same on a GPU: a 126M GPT, eager and compiled

Every recipe key with its type, default and meaning: docs/recipe.md (README.md, section Recipes, shows
them as one recipe).
Exit codes: 0 done, 1 a bug (traceback), 2 a mistake (one line), 3 NaN loss, 4 requeue refused,
5 out of memory, 6 a collective timed out, 128+N stopped by signal N (checkpoint saved)."""


def main(argv: Optional[List[str]] = None) -> int:
    parser = _Parser(prog="python -m launcher", usage=USAGE, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="Train the model a YAML recipe describes. Overrides use OmegaConf's dotlist syntax.")
    parser.add_argument("recipe", nargs="?", help="the recipe file, e.g. recipes/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. trainer.max_steps=100")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    args = parser.parse_args(argv)
    if args.recipe is None:
        parser.error("a recipe file is required, e.g. python -m launcher recipes/quickstart.yaml")
    try:
        from launcher.recipe import load

        loaded = load(args.recipe, args.overrides)
        if args.print_config:
            from omegaconf import OmegaConf

            for note in loaded.notes:
                print(note, file=sys.stderr)
            print(OmegaConf.to_yaml(loaded.config), end="")
            return 0
        from launcher.train import run

        return run(loaded, args.overrides)
    except UserError as e:
        _report(e)
        return EXIT_USER
    except Stopped as e:
        return exit_code(e.signum)
    except RequeueFailed as e:
        _say(str(e))
        return EXIT_REQUEUE
    except PeerFailed as e:
        # For torchrun's report, dated after the failed rank's exit so that it stays the root cause there;
        # the screen keeps the cause last.
        _for_torchrun([f"launcher: rank {_rank()}: {e}"], later=60)
        return EXIT_BUG
    except Hung as e:
        _say(str(e), every_rank=True)
        _for_torchrun([f"launcher: rank {_rank()}: {e}"])
        return EXIT_HUNG
    except OutOfMemory as e:
        _say(str(e), every_rank=True)  # each rank's own: its step, its device, its peak
        return EXIT_OOM
    except TrainingDiverged as e:
        _say(f"{e}; stopped without saving. The last good checkpoint is kept; lower the learning rate "
             f"or enable trainer.clip_grad_norm, then resume")
        return EXIT_DIVERGED


def _rank() -> str:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def _report(e: UserError) -> None:
    """Say a mistake once per run: rank 0 says it, and another rank too unless it knows rank 0 says the same."""
    rank = _rank()
    # Under a real torchrun every rank meets the same recipe problem; an agreed one every rank learnt of.
    rank0_says_it = not e.every_rank and (e.agreed or "TORCHELASTIC_RUN_ID" in os.environ)
    if rank != "0" and rank0_says_it:
        # Dated later than rank 0's: torchrun names the earliest error file as the root cause, and both
        # are written within the same second or two (an equal or earlier date here won 2 full runs in 2).
        _for_torchrun(["launcher: rank 0 reports the mistake"], later=60)
        # torchrun stops every rank as soon as one exits: give rank 0, busy with the same work,
        # the moment it needs to say it.
        time.sleep(3)
        return
    for problem in e.problems:
        _print(problem, prefixed=rank != "0" or (e.every_rank and _several()))
    _for_torchrun([f"launcher: {p}" for p in e.problems])


def _say(message: str, every_rank: bool = False) -> None:
    """A line that rank 0 says for every rank, or with every_rank, each rank for itself."""
    if _rank() == "0" or every_rank:
        _print(message, prefixed=every_rank and _several())


def _several() -> bool:
    return os.environ.get("WORLD_SIZE", "1") != "1"


def _print(message: str, prefixed: bool) -> None:
    prefix = f"[rank {_rank()}] " if prefixed else ""
    print(f"{prefix}launcher: {message}", file=sys.stderr, flush=True)


def _for_torchrun(lines: List[str], later: int = 0) -> None:
    """torchrun's failure report shows a worker's error file, else "To enable traceback see: ...": give it
    our lines, in the format of torch's own ErrorHandler, so the report names the mistake."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = "\n".join(lines)
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()) + later)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the report then says what it says without it; our line is on stderr already
