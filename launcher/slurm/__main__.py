"""python -m launcher.slurm {submit,render} RECIPE [--nodes N ...] [key=value ...]

Options may also sit in the recipe's `slurm:` section; the command line wins. `render` prints the
script and submits nothing; `submit` writes it into the run folder, calls sbatch, and says where
the logs go.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from launcher.errors import UserError
from launcher.recipe.schema import SlurmConfig

USAGE = "python -m launcher.slurm {submit,render} RECIPE [--nodes N --gpus-per-node G ...] [key=value ...]"
LISTS = {"sbatch", "setup"}  # options that may be given more than once


def options_help() -> str:
    return ", ".join(f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(SlurmConfig))


def parse(argv: List[str]):
    """(command, recipe, slurm overrides, training overrides) from the command line."""
    if len(argv) < 2 or argv[0] not in ("submit", "render"):
        raise UserError(f"usage: {USAGE}")
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
            if flag not in names:
                raise UserError(f"unknown option --{flag}; valid: {options_help()}")
            if not eq:
                if i + 1 >= len(rest):
                    raise UserError(f"option --{flag} needs a value")
                i += 1
                value = rest[i]
            if names[flag] in LISTS:
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
    from launcher.cli import _say

    try:
        command, recipe, slurm, training = parse(sys.argv[1:] if argv is None else argv)
        from launcher.recipe import load
        from launcher.slurm.render import render

        loaded = load(recipe, [*training, *slurm])
        run_dir = Path(loaded.recipe.run_dir).resolve()
        script = render(loaded.recipe.slurm, recipe.resolve(), training, run_dir, loaded.recipe.name, Path.cwd())
        if command == "render":
            print(script, end="")
            return 0
        return submit(script, run_dir)
    except UserError as e:
        for problem in e.problems:
            _say(_as_flag(problem))
        return 2


def _as_flag(problem: str) -> str:
    """"override 'slurm.nodes=two': slurm.nodes: ..." -> "--nodes two: ...": name what the user typed."""
    m = re.match(r"override 'slurm\.(\w+)=(.*?)': slurm\.\w+: (.*)", problem)
    return f"--{m.group(1).replace('_', '-')} {m.group(2)}: {m.group(3)}" if m else problem


def submit(script: str, run_dir: Path) -> int:
    if shutil.which("sbatch") is None:
        raise UserError("sbatch is not on PATH. HINT: submit from a Slurm login node, or start the local "
                        "cluster (bash slurm/local/up.sh) and export SLURM_CONF as it says")
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.sbatch"
    path.write_text(script)
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"sbatch refused {path}: {reason}")
    job = done.stdout.strip().split(";")[0]
    print(f"submitted job {job}: script {path}, logs {folder / (job + '.out')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
