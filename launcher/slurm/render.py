"""The sbatch script as a pure function of typed options, the recipe and its overrides."""

from __future__ import annotations

import shlex
from pathlib import Path
from string import Template
from typing import List, Optional

from launcher.errors import UserError
from launcher.recipe.schema import SlurmConfig

TEMPLATES = Path(__file__).resolve().parents[2] / "slurm"


BARE_PYTHON = ("this script runs a bare `python`: the first on the nodes' PATH, which may lack torch and the "
               "launcher; name one with --python /path/to/venv/bin/python, or activate an environment with "
               "--setup 'source .venv/bin/activate'")


def bare_python(options: SlurmConfig) -> bool:
    return options.python == "python" and not options.setup


def render(options: SlurmConfig, recipe: Path, overrides: List[str], run_dir: Path, name: str, workdir: Path,
           arguments: Optional[str] = None) -> str:
    """The script. `run_dir` and `workdir` are absolute, so the job finds what the submitter meant. `arguments`,
    shell words, replace the recipe and its overrides after `-m launcher` (a job array's task picks its own)."""
    template = TEMPLATES / f"{options.layout}.sbatch"
    if not template.is_file():
        raise UserError(f"slurm.layout: no template {template}; the slurm/ folder of the launcher's "
                        f"source tree is needed (install it with pip install -e)")
    per_node = options.tasks_per_node or max(options.gpus_per_node, 1)
    lines = [f"--job-name={options.job_name or name}", f"--nodes={options.nodes}", f"--time={options.time}",
             f"--chdir={workdir}",
             f"--output={options.output or run_dir / 'slurm' / '%j.out'}"]
    if options.error:
        lines.append(f"--error={options.error}")
    if options.layout == "torchrun":
        lines.append("--ntasks-per-node=1")
    else:
        lines.append(f"--ntasks-per-node={per_node}")
    if options.gpus_per_node:
        lines.append(f"--gpus-per-node={options.gpus_per_node}")
    for flag in ("cpus_per_task", "mem", "partition", "account", "qos"):
        value = getattr(options, flag)
        if value is not None:
            lines.append(f"--{flag.replace('_', '-')}={value}")
    if options.signal_seconds:
        lines.append(f"--signal=USR1@{options.signal_seconds}")  # to the job step: the launcher saves, requeues
    lines += ["--requeue", "--open-mode=append"]  # a requeued job appends to the same log
    lines += list(options.sbatch)
    # run_dir resolved to an absolute path replaces the one the command line gave (the job runs elsewhere)
    args = [str(recipe), *(o for o in overrides if not o.startswith("run_dir=")), f"run_dir={run_dir}"]
    setup = list(options.setup)
    if bare_python(options):
        setup.insert(0, f"# {BARE_PYTHON}")
    return Template(template.read_text()).substitute(
        sbatch_lines="\n".join(f"#SBATCH {line}" for line in lines),
        setup_lines="\n".join(setup),
        python=shlex.quote(options.python),
        nproc_per_node=per_node,
        recipe_args=arguments if arguments is not None else " ".join(shlex.quote(a) for a in args),
    )
