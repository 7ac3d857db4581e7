"""python -m launcher.slurm {submit,render} RECIPE [--nodes N ...] [key=value ...]

Options may also sit in the recipe's `slurm:` section; the command line wins. `render` prints the
script and submits nothing; `submit` writes it into the run folder, calls sbatch, and says where
the logs go.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import List, Optional

from launcher.errors import UserError
from launcher.report import say
from launcher.recipe.schema import SlurmConfig
from launcher.slurm.sbatch import submit

USAGE = "python -m launcher.slurm {submit,render} RECIPE [--nodes N --gpus-per-node G ...] [key=value ...]"
LISTS = {"sbatch", "setup"}  # options that may be given more than once
COMMANDS = {"submit": "write the sbatch script into <run_dir>/slurm/job.sbatch and submit it with sbatch",
            "render": "print the sbatch script; submit nothing"}
# Options that set a recipe key (passed on to the job as an override, like key=value).
KEYS = {"replica-groups": ("fault_tolerance.groups", "replica groups of a fault-tolerant run: the lighthouse as "
                                                     "one job, the groups as a job array (docs/fault-tolerance.md)")}
# What each option means (every field of SlurmConfig; tests/test_slurm_render.py checks that none is missing).
MEANING = {
    "nodes": "nodes to allocate",
    "gpus_per_node": "GPUs per node; each rank takes the GPU of its local rank",
    "tasks_per_node": "processes per node (default: --gpus-per-node, or 1)",
    "cpus_per_task": "CPUs per task (default: Slurm's)",
    "mem": "memory per node, e.g. 32G (default: Slurm's)",
    "time": "time limit: MM, HH:MM:SS or D-HH:MM:SS",
    "partition": "partition, the queue (default: the cluster's)",
    "account": "account to charge (default: your own)",
    "qos": "quality of service (default: the cluster's)",
    "job_name": "job name (default: the recipe's name)",
    "output": "log file (default: <run_dir>/slurm/%j.out)",
    "error": "error log (default: with the output)",
    "layout": "torchrun: one torchrun per node | srun: one task per process, srun alone",
    "signal_seconds": "Slurm signals the job this many seconds before its time limit: save and requeue (0: no signal)",
    "python": "the interpreter on the nodes, run after the setup lines",
    "sbatch": "an extra '#SBATCH' line, without the prefix (repeatable; default: none)",
    "setup": "a shell line run before training: module load, source .venv/bin/activate (repeatable; default: none)",
}


def options_help() -> str:
    return ", ".join([*(f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(SlurmConfig)), *(f"--{k}" for k in KEYS)])


def help_text(command: Optional[str] = None) -> str:
    """--help: the commands, or one command, and every option with its meaning and default."""
    usage = USAGE if command is None else f"python -m launcher.slurm {command} RECIPE [--option VALUE ...] [key=value ...]"
    lines = [f"usage: {usage}", ""]
    if command is None:
        lines += ["Train a recipe on a Slurm cluster: one sbatch job, requeued after a preemption or time limit.", "",
                  "commands:"] + [f"  {name:8} {what}" for name, what in COMMANDS.items()] + [
                  "", "`python -m launcher.slurm COMMAND --help` says the same of one command.", ""]
    else:
        lines += [COMMANDS[command] + ".", ""]
    lines += ["RECIPE is the recipe file; key=value are the recipe's overrides, passed on to the job.",
              "The options may also sit in the recipe's slurm: section; the command line wins.", "", "options:"]
    for f in dataclasses.fields(SlurmConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = f" [default: {default}]" if default not in (None, []) else ""  # unset ones say theirs in words
        lines.append(f"  --{f.name.replace('_', '-'):16} {MEANING[f.name]}{shown}")
    lines += [f"  --{flag:16} {meaning} [the recipe's {key}]" for flag, (key, meaning) in KEYS.items()]
    lines += ["", "Example: python -m launcher.slurm submit recipes/quickstart.yaml --nodes 2 --gpus-per-node 4 \\",
              "           --time 12:00:00 --setup 'source .venv/bin/activate' trainer.max_steps=20000",
              "", "Docs: docs/slurm-and-sweeps.md (in the source tree)."]
    return "\n".join(lines)


def parse(argv: List[str]):
    """(command, recipe, slurm overrides, training overrides) from the command line, or (help text, ...)
    for --help."""
    if not argv or argv[0] in ("-h", "--help"):
        if argv:
            return "help", help_text(), [], []
        raise UserError(f"a command is required: submit or render (usage: {USAGE}; --help lists the options)")
    if argv[0] not in COMMANDS:
        raise UserError(f"unknown command {argv[0]!r}; valid: submit, render (usage: {USAGE})")
    if "-h" in argv[1:] or "--help" in argv[1:]:
        return "help", help_text(argv[0]), [], []
    if len(argv) < 2:
        raise UserError(f"{argv[0]}: a recipe file is required (usage: {USAGE})")
    command, recipe, rest = argv[0], argv[1], argv[2:]
    names = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(SlurmConfig)}
    slurm: List[str] = []
    lists: dict = {}
    training: List[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg.startswith("--"):
            flag, eq, value = arg[2:].partition("=")
            if flag not in names and flag not in KEYS:
                raise UserError(f"unknown option --{flag}; valid: {options_help()}")
            if not eq:
                if i + 1 >= len(rest):
                    raise UserError(f"option --{flag} needs a value")
                i += 1
                value = rest[i]
            if flag in KEYS:
                training.append(f"{KEYS[flag][0]}={value}")
            elif names[flag] in LISTS:
                lists.setdefault(names[flag], []).append(value)
            else:
                slurm.append(f"slurm.{names[flag]}={value}")
        else:
            training.append(arg)
        i += 1
    for key, values in lists.items():
        slurm.append(f"slurm.{key}=[{', '.join(_quoted(v) for v in values)}]")
    return command, Path(recipe), slurm, training


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def main(argv: Optional[List[str]] = None) -> int:
    try:
        command, recipe, slurm, training = parse(sys.argv[1:] if argv is None else argv)
        if command == "help":
            print(recipe)
            return 0
        from launcher.recipe import load
        from launcher.slurm.render import BARE_PYTHON, bare_python, render

        loaded = load(recipe, [*training, *slurm])
        run_dir = Path(loaded.recipe.run_dir).resolve()
        if loaded.recipe.fault_tolerance is not None:
            return _replica_groups(command, loaded, recipe, training, run_dir)
        script = render(loaded.recipe.slurm, recipe.resolve(), training, run_dir, loaded.recipe.name, Path.cwd())
        if bare_python(loaded.recipe.slurm):  # beside the script, not in it: `render > job.sbatch` stays a script
            print(f"launcher.slurm: {BARE_PYTHON}", file=sys.stderr)
        if command == "render":
            print(script, end="")
            return 0
        return submit(script, run_dir)
    except UserError as e:
        for problem in e.problems:
            say(_as_flag(problem))
        return 2


def _replica_groups(command: str, loaded, recipe: Path, training: List[str], run_dir: Path) -> int:
    """A fault-tolerant run: the lighthouse's job and the groups' job array (launcher/slurm/groups.py)."""
    from launcher.slurm import groups
    from launcher.slurm.render import BARE_PYTHON, bare_python

    section = loaded.recipe.fault_tolerance
    lighthouse, array = groups.scripts(loaded.recipe.slurm, section, recipe.resolve(), training, run_dir,
                                       loaded.recipe.name, Path.cwd())
    if bare_python(loaded.recipe.slurm):
        print(f"launcher.slurm: {BARE_PYTHON}", file=sys.stderr)
    if command == "render":  # two scripts, each under the name submit writes it as
        for name, script in (("lighthouse.sbatch", lighthouse), ("groups.sbatch", array)):
            if script:
                print(f"# ===== {run_dir / 'slurm' / name} =====\n{script}", end="")
        return 0
    return groups.submit(lighthouse, array, run_dir, section.groups)


def _as_flag(problem: str) -> str:
    """"override 'slurm.nodes=two': slurm.nodes: ..." -> "--nodes two: ...": name what the user typed."""
    m = re.match(r"override 'slurm\.(\w+)=(.*?)': slurm\.\w+: (.*)", problem)
    if m:
        return f"--{m.group(1).replace('_', '-')} {m.group(2)}: {m.group(3)}"
    for flag, (key, _) in KEYS.items():  # "--replica-groups 0: fault_tolerance.groups: ...": the flag and its key
        if problem.startswith(f"override '{key}="):
            value, _, rest = problem[len(f"override '{key}="):].partition("': ")
            return f"--{flag} {value}: {rest}"
    return problem


if __name__ == "__main__":
    sys.exit(main())
