"""A sweep from its command line, checked whole before anything starts: the grid, and each run's recipe (every
combination loaded as its run will load it, with what the sweep adds: launcher/sweep/folder.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

from launcher.errors import UserError
from launcher.sweep import grid
from launcher.sweep.folder import Sweep
from launcher.sweep.grid import Run


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
        checkpoints = base.checkpoint.dir
    except UserError as e:  # the combinations are still checked: every problem at once
        problems += e.problems
        where, trackers, checkpoints = Path("sweep").resolve(), [], None
    sweep = Sweep(where, str(Path(recipe).resolve()), plain, axes, runs, trackers, checkpoints)
    seen: Dict[str, Run] = {}
    for run in runs:
        try:
            loaded = load(recipe, sweep.arguments(run)[1:])
        except UserError as e:
            problems += [p for p in e.problems if p not in problems]
            continue
        first = seen.setdefault(_what_it_trains(loaded.config, sweep.run_dir(run)), run)
        if first is not run and not any(p.startswith(_values_of(first, run)) for p in problems):
            problems.append(_twice(first, run))  # once for the two values, whatever the other keys' values
    if problems:
        raise UserError(*problems)
    return sweep


def _what_it_trains(config, run_dir: Path) -> str:
    """The run's resolved recipe less what the sweep sets apart for each run (its folder, its checkpoints'
    folder, its name in the trackers): two runs alike here would train the same thing twice (0.1 and 1e-1, 3
    and '3')."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_container(config, resolve=True)
    resolved.pop("run_dir", None)
    resolved.get("checkpoint", {}).pop("dir", None)  # each run's own below the recipe's
    for tracker in ("mlflow", "wandb"):
        if isinstance(resolved.get("logging", {}).get(tracker), dict):
            resolved["logging"][tracker].pop("run_name", None)
    return json.dumps(resolved, sort_keys=True, default=repr).replace(json.dumps(str(run_dir))[1:-1], "<run>")


def _values_of(first: Run, run: Run) -> str:
    """What sets two runs apart: `a=1 and a=1e0`."""
    ours = [o for o in first.overrides if o not in run.overrides]
    theirs = [o for o in run.overrides if o not in first.overrides]
    return f"{' '.join(ours)} and {' '.join(theirs)}"


def _twice(first: Run, run: Run) -> str:
    keys = {o.partition("=")[0] for o in first.overrides if o not in run.overrides}
    hint = "" if keys == {"seed"} else " (to repeat a run, sweep its seed: seed=range(3))"
    return (f"{_values_of(first, run)}: the same run twice (one recipe in the folders {first.name}/ and "
            f"{run.name}/); give each value once{hint}")
