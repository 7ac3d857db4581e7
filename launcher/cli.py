"""The command line: parse, load the recipe, hand off to training, turn outcomes into exit codes.

0 done; 1 the loss diverged; 2 a user mistake, one line per problem on stderr; anything else a bug,
with its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

from launcher.errors import TrainingDiverged, UserError
from launcher.stopping import RequeueFailed, Stopped, exit_code

USAGE = "python -m launcher RECIPE.yaml [key=value ...] [--print-config]"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        _say(f"{message} (usage: {USAGE})")
        raise SystemExit(2)


def main(argv: Optional[List[str]] = None) -> int:
    parser = _Parser(prog="python -m launcher", usage=USAGE,
                     description="Train the model a YAML recipe describes. Overrides use OmegaConf's dotlist syntax.")
    parser.add_argument("recipe", help="the recipe file, e.g. recipes/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. trainer.max_steps=100")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    args = parser.parse_args(argv)
    try:
        from launcher.recipe import load

        loaded = load(args.recipe, args.overrides)
        if args.print_config:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(loaded.config), end="")
            return 0
        from launcher.train import run

        return run(loaded, args.overrides)
    except UserError as e:
        for problem in e.problems:
            _say(problem, every_rank=e.every_rank)
        if not e.every_rank and _rank() != "0":
            # Rank 0 reports this one. torchrun stops every rank as soon as one exits, so give
            # rank 0, busy with the same work, the moment it needs to say it.
            time.sleep(3)
        return 2
    except Stopped as e:
        return exit_code(e.signum)
    except RequeueFailed as e:
        _say(str(e))
        return 1
    except TrainingDiverged as e:
        _say(f"{e}; stopped without saving. The last good checkpoint is kept; lower the learning rate "
             f"or enable trainer.clip_grad_norm, then resume")
        return 1


def _rank() -> str:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def _say(message: str, every_rank: bool = False) -> None:
    # Under torchrun every rank meets the same recipe problem: only global rank 0 prints it.
    rank = _rank()
    if rank == "0" or every_rank:
        prefix = f"[rank {rank}] " if every_rank and "WORLD_SIZE" in os.environ else ""
        print(f"{prefix}launcher: {message}", file=sys.stderr, flush=True)
