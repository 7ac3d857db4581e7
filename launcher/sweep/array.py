"""A sweep as one Slurm job array: `sbatch --array=0-(N-1)%K`, task i running combination i with the resources
of the recipe's `slurm:` section (and python -m launcher.slurm's options), from the same templates as a single
job (slurm/). Each task's script picks its run's overrides by SLURM_ARRAY_TASK_ID and records how the run's
process ended; a preempted task saves, requeues itself (launcher/stopping.py requeues the array task), and
resumes from its checkpoint."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Optional

from launcher.sweep.folder import Sweep


def script(sweep: Sweep, recipe: Path, options: List[str], max_parallel: Optional[int]) -> str:
    """The array's sbatch script: the single job's, its command given the task's run."""
    from launcher.recipe import load
    from launcher.slurm.__main__ import parse
    from launcher.slurm.render import render

    _, _, slurm, _ = parse(["render", str(recipe), *options])
    config = load(recipe, [*sweep.overrides, *slurm]).recipe.slurm
    limit = f"%{max_parallel}" if max_parallel else ""
    config.sbatch = [*config.sbatch, f"--array=0-{len(sweep.runs) - 1}{limit}"]
    config.output = config.output or str(sweep.folder / "slurm" / "%A_%a.out")
    config.job_name = config.job_name or sweep.folder.name
    python = shlex.quote(config.python)
    cases = [f"    {i}) RUN=({' '.join(shlex.quote(a) for a in sweep.arguments(run)[1:])}); "
             f"RUN_DIR={shlex.quote(str(sweep.run_dir(run)))} ;;" for i, run in enumerate(sweep.runs)]
    config.setup = [*config.setup, "# this task's run: combination $SLURM_ARRAY_TASK_ID of the sweep (sweep.json)",
                    'case "$SLURM_ARRAY_TASK_ID" in', *cases, "esac", "started=$(date +%s)",
                    f"trap '{python} -m launcher.sweep mark \"$RUN_DIR\" $? $started' EXIT"]
    return render(config, Path(sweep.recipe), sweep.overrides, sweep.folder, sweep.folder.name, Path.cwd(),
                  arguments=f'{shlex.quote(sweep.recipe)} "${{RUN[@]}}"')


def submit(sweep: Sweep, recipe: Path, options: List[str], max_parallel: Optional[int]) -> int:
    from launcher.slurm.sbatch import submit as sbatch

    at_once = f", {max_parallel} at a time" if max_parallel else ""
    return sbatch(script(sweep, recipe, options, max_parallel), sweep.folder, name="array.sbatch",
                  what=f"job array of {len(sweep.runs)} tasks{at_once}", logs="{job}_<task>.out")
