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
import sys
from typing import List, Optional

from launcher.errors import (EXIT_BUG, EXIT_CHECKPOINTS, EXIT_DIVERGED, EXIT_HUNG, EXIT_OOM, EXIT_REQUEUE, EXIT_USER,
                             CheckpointsFailed, Hung, OutOfMemory, PeerFailed, TrainingDiverged, UserError)
from launcher.report import agreed, for_torchrun, mistake, rank, say
from launcher.stopping import RequeueFailed, Stopped, exit_code

USAGE = "python -m launcher RECIPE.yaml [key=value ...] [--print-config]"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        mistake(UserError(f"{message} (usage: {USAGE})"))
        raise SystemExit(EXIT_USER)


EPILOG = """commands (each takes --help):
  python -m launcher RECIPE [key=value ...]         train (torchrun, accelerate launch and srun start this too)
  python -m launcher.slurm submit|render RECIPE ... an sbatch job of the recipe, requeued after preemption
  python -m launcher.sweep RECIPE key=a,b ...       one run per combination, here or as a Slurm job array
  python -m launcher.export CHECKPOINT OUT          a checkpoint (any strategy) as one plain model file
  python -m launcher.plan RECIPE --devices N ...    peak memory per rank under each layout, and the one to use
  python -m launcher.ft RECIPE ...                  replica groups (torchft): the others train on when one dies
  python -m launcher.bench                          the launcher against a hand-written loop (CPU)
  python -m launcher.bench.gpu                      the same on a GPU: a 126M GPT, eager and compiled

Docs (docs/ in the source tree): launching it (one process, torchrun, accelerate launch): docs/launching.md;
every recipe key with its type, default and meaning: docs/recipe.md; exit codes and every kind of
one-line mistake: docs/troubleshooting.md.
Exit codes: 0 done, 1 a bug (traceback), 2 a mistake (one line), 3 NaN loss, 4 requeue refused,
5 out of memory, 6 a collective timed out, 7 saves kept failing, 128+N stopped by signal N (checkpoint saved)."""


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
        from launcher.run.train import run

        return run(loaded, args.overrides)
    except UserError as e:
        mistake(e)
        return EXIT_USER
    except Stopped as e:
        return exit_code(e.signum)
    except RequeueFailed as e:
        say(str(e))
        return EXIT_REQUEUE
    except PeerFailed as e:
        # For torchrun's report, dated after the failed rank's exit so that it stays the root cause there;
        # the screen keeps the cause last.
        for_torchrun([f"launcher: rank {rank()}: {e}"], later=60)
        return EXIT_BUG
    except Hung as e:
        say(str(e), every_rank=True)
        for_torchrun([f"launcher: rank {rank()}: {e}"])
        return EXIT_HUNG
    except CheckpointsFailed as e:
        agreed(str(e))  # every rank meets it at the same save (its failure is agreed)
        return EXIT_CHECKPOINTS
    except OutOfMemory as e:
        say(str(e), every_rank=True)  # each rank's own: its step, its device, its peak
        return EXIT_OOM
    except TrainingDiverged as e:
        # every rank meets it at the same step (the losses are all-reduced before they are checked)
        agreed(f"{e}; stopped without saving. The last good checkpoint is kept; lower the learning rate "
               f"or enable trainer.clip_grad_norm, then resume")
        return EXIT_DIVERGED
