"""A sweep's combinations that will not fit, left out before anything starts: each run's own layout planned on
fake tensors (python -m launcher.plan), its peak per rank against the memory of one device."""

from __future__ import annotations

from typing import Callable, List

from launcher.errors import UserError
from launcher.sweep.folder import Sweep


def fitting(sweep: Sweep, memory: str, devices: int, say: Callable[[str], None]) -> Sweep:
    """The sweep less its runs whose planned peak exceeds `memory` on `devices` devices, each said in a line;
    a UserError when none is left."""
    from launcher.plan import planner
    from launcher.recipe import load

    limit = planner.size(memory, "--memory")
    kept, left = [], []
    for run in sweep.runs:
        recipe = load(sweep.recipe, sweep.arguments(run)[1:]).recipe
        layout = planner.own_layout(recipe, devices)
        row = planner.plan(recipe, [layout], limit, "cuda", largest=False, jobs=1)[0] if layout else None
        if row is None or row.peak is None or row.fits:  # what the planner cannot plan runs, as it would have
            kept.append(run)
            continue
        left.append(run)
        say(f"sweep: left out {run.name} ({' '.join(run.overrides)}): planned {row.peak.total / 2**30:.2f} GiB per "
            f"rank under {layout.name}, more than --memory {memory}")
    if not kept:
        raise UserError(f"--memory {memory}: none of the {len(left)} runs fits on {devices} device(s) of that memory "
                        f"(python -m launcher.plan RECIPE --devices {devices} --memory {memory} shows each layout)")
    sweep.runs = kept
    return sweep
