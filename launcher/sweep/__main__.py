"""python -m launcher.sweep RECIPE key=a,b,c key2=range(1,4) [key=value ...] [--dry-run] [--parallel N]
                           [--gpus-per-run K] [--share-gpus] [--max-runs 100] [--yes]
                           [--slurm [--max-parallel K] [--nodes N --time ... (python -m launcher.slurm's options)]]
python -m launcher.sweep report SWEEP_FOLDER [--best KEY [--max]] [--csv | --markdown]

Every combination of the swept values is one run of the recipe, in its own folder under the recipe's run_dir
(the sweep's folder, which sweep.json describes). Locally the runs go one after another (or --parallel N at
once); with --slurm, one sbatch job array whose task i runs combination i. Started again, a sweep skips the
runs that are done and resumes the others. At the end, or any time with `report`, one table of the runs.

Docs: docs/slurm-and-sweeps.md#sweeps (in the source tree)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from launcher.errors import UserError
from launcher.report import say
from launcher.sweep import folder, local
from launcher.sweep.plan import plan


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launcher.sweep", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their folders; start nothing")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once on this machine (default 1)")
    parser.add_argument("--gpus-per-run", type=int, default=1, help="GPUs each run gets, where there are GPUs (default 1)")
    parser.add_argument("--share-gpus", action="store_true", help="let several runs share a GPU")
    parser.add_argument("--max-runs", type=int, default=100, help="more combinations than this need --yes (default 100)")
    parser.add_argument("--yes", action="store_true", help="start more than --max-runs runs")
    parser.add_argument("--slurm", action="store_true", help="submit one Slurm job array instead of running here")
    parser.add_argument("--memory", help="one device's memory (80GB): runs whose planned peak per rank exceeds it "
                                         "are left out before anything starts (python -m launcher.plan)")
    parser.add_argument("--devices", type=int, help="with --memory: the devices of one run (default --gpus-per-run)")
    parser.add_argument("--max-parallel", type=int, help="with --slurm: array tasks running at once (sbatch's %%K)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["report"]:
            from launcher.sweep import report

            return report.main(argv[1:])
        if argv[:1] == ["mark"]:  # the Slurm array task's script: how its run's process ended
            if len(argv) != 4:
                raise UserError("mark RUN_FOLDER EXIT_CODE STARTED: what a Slurm array task's script calls when "
                                "its run ends (not for typing)")
            folder.mark_exit(Path(argv[1]), int(argv[2]), float(argv[3]))
            return 0
        return _sweep(argv)
    except UserError as e:
        for problem in e.problems:
            say(problem)
        return 2


def _sweep(argv: List[str]) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    overrides = [a for a in rest if "=" in a and not a.startswith("-")]
    options = [a for a in rest if a not in overrides]
    if options and not args.slurm:
        own = [o for action in parser._actions for o in action.option_strings if o.startswith("--") and o != "--help"]
        raise UserError(f"unknown option {options[0]}; the sweep's: {', '.join(own)} (Slurm's options follow --slurm)")
    if args.parallel < 1 or args.gpus_per_run < 1:
        raise UserError("--parallel and --gpus-per-run: must be 1 or more")
    if args.max_parallel is not None and (not args.slurm or args.max_parallel < 1):
        raise UserError("--max-parallel: array tasks at once, 1 or more, with --slurm" if args.slurm else
                        "--max-parallel: with --slurm (a job array's tasks at once); on this machine, --parallel N")
    sweep = plan(args.recipe, overrides, args.max_runs, args.yes)
    if args.memory:
        from launcher.sweep.fits import fitting

        sweep = fitting(sweep, args.memory, args.devices or args.gpus_per_run, say)
    if args.dry_run:
        _print_runs(sweep)
        if args.slurm:  # and the array's script, as python -m launcher.slurm render prints a job's
            from launcher.sweep.array import script

            print(script(sweep, args.recipe, options, args.max_parallel), end="")
        return 0
    sweep.write()
    if args.slurm:
        from launcher.sweep.array import submit

        return submit(sweep, args.recipe, options, args.max_parallel)
    slots = local.gpu_groups(args.gpus_per_run, args.parallel, args.share_gpus)
    code = local.run_all(sweep, sweep.arguments, slots, print)
    from launcher.sweep import report

    print(report.render(report.rows(sweep), "table"))
    return code


def _print_runs(sweep: folder.Sweep) -> None:
    every = f" (every run: {' '.join(sweep.overrides)})" if sweep.overrides else ""
    print(f"sweep: {len(sweep.runs)} runs of {sweep.recipe} in {sweep.folder}{every}")
    width = max(len(str(sweep.run_dir(r))) for r in sweep.runs)
    for run in sweep.runs:
        state = folder.status(sweep.run_dir(run)).describe()
        print(f"  {str(sweep.run_dir(run)):{width}}  {' '.join(run.overrides)}  [{state}]")


if __name__ == "__main__":
    sys.exit(main())
