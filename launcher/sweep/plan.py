"""A sweep from its command line, checked whole before anything starts: the grid, and each run's recipe (every
combination loaded as its run will load it, with what the sweep adds: launcher/sweep/folder.py)."""

from __future__ import annotations

from pathlib import Path
from typing import List

from launcher.errors import UserError
from launcher.sweep import grid
from launcher.sweep.folder import Sweep


def plan(recipe: Path, args: List[str], max_runs: int, yes: bool) -> Sweep:
    """The sweep, or a UserError listing every problem of every combination at once."""
    from launcher.recipe import load

    axes, plain = grid.split(args)
    problems: List[str] = []
    if not axes:
        problems.append("no key is swept: give one several values, key=a,b,c or key=range(1,4) (to train once: "
                        "python -m launcher RECIPE)")
    runs = grid.runs(axes) if axes else []
    if len(runs) > max_runs and not yes:
        sizes = f" ({' x '.join(str(len(v)) for v in axes.values())})" if len(axes) > 1 else ""
        problems.append(f"{len(runs)} runs{sizes} are more than --max-runs {max_runs}; add --yes to start them "
                        f"all, or sweep fewer values")
    try:
        base = load(recipe, plain).recipe
        where, trackers = Path(base.run_dir).resolve(), [t for t in ("mlflow", "wandb") if getattr(base.logging, t)]
    except UserError as e:  # the combinations are still checked: every problem at once
        problems += e.problems
        where, trackers = Path("sweep").resolve(), []
    sweep = Sweep(where, str(Path(recipe).resolve()), plain, axes, runs, trackers)
    for run in runs:
        try:
            load(recipe, sweep.arguments(run)[1:])
        except UserError as e:
            problems += [p for p in e.problems if p not in problems]
    if problems:
        raise UserError(*problems)
    return sweep

