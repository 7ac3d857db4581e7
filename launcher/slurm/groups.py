"""A fault-tolerant run on Slurm (`python -m launcher.slurm submit RECIPE --replica-groups N`, or a recipe with a
`fault_tolerance:` section): the lighthouse as one job, the replica groups as one job array whose task g is
group g, each task requeued on its own.

- The lighthouse's job (slurm/lighthouse.sbatch) runs `python -m launcher.ft --lighthouse` on a free port,
  writes its address into `<run_dir>/slurm/lighthouse.address`, and serves until none of the groups' tasks is
  left in the queue (their array's id is written into `<run_dir>/slurm/groups.job` once it is queued).
- The groups' array (`--array=0-(N-1)`, the layout's template, slurm/torchrun.sbatch or srun.sbatch, with the
  resources of one group) starts once the lighthouse has started (`--dependency=after:<its job>`). Task g
  exports REPLICA_GROUP_ID=g and TORCHFT_LIGHTHOUSE (read from the address file, which it waits for), and
  trains in `<run_dir>/group_<g>`.
- A task that fails (any exit but 0 and 2, a user mistake) requeues itself, up to REQUEUES restarts: started
  again, the group copies the live groups' state and trains on with them. A preempted task saves and requeues
  itself as every launcher job does (launcher/stopping.py: the array task alone); the live groups train on.

With fault_tolerance.lighthouse set, that lighthouse is used and no lighthouse job is submitted.
"""

from __future__ import annotations

import copy
import shlex
import subprocess
from pathlib import Path
from string import Template
from typing import List, Tuple

from launcher.errors import UserError
from launcher.recipe.schema import SlurmConfig
from launcher.slurm.render import TEMPLATES, render
from launcher.slurm.sbatch import sbatch

REQUEUES = 3  # restarts of a failed group's task (SLURM_RESTART_COUNT counts preemptions too)
ADDRESS_WAIT = 600  # seconds a group's task waits for the lighthouse's address
POLL = 10  # seconds between the lighthouse's looks at the queue
ADDRESS, GROUPS_JOB = "lighthouse.address", "groups.job"  # in <run_dir>/slurm/


def scripts(options: SlurmConfig, section, recipe: Path, overrides: List[str], run_dir: Path, name: str,
            workdir: Path) -> Tuple[str, str]:
    """(the lighthouse's script, or '' where fault_tolerance.lighthouse names one; the groups' array's script)."""
    if section.group is not None:
        raise UserError(f"fault_tolerance.group: set to {section.group}, but python -m launcher.slurm submits every "
                        f"group of the run (a job array, task g for group g); leave it out")
    folder = run_dir / "slurm"
    kept = [o for o in overrides if not o.startswith("run_dir=")]
    lighthouse = "" if section.lighthouse else _lighthouse(options, recipe, kept, folder, name, workdir)
    return lighthouse, _groups(options, section, recipe, kept, run_dir, name, workdir)


def _lighthouse(options: SlurmConfig, recipe: Path, overrides: List[str], folder: Path, name: str,
                workdir: Path) -> str:
    lines = [f"--job-name={options.job_name or name}-lighthouse", "--nodes=1", "--ntasks=1", f"--time={options.time}",
             f"--chdir={workdir}", f"--output={folder / 'lighthouse-%j.out'}"]
    lines += [f"--{flag}={getattr(options, flag)}" for flag in ("partition", "account", "qos")
              if getattr(options, flag) is not None]
    lines += ["--requeue", "--open-mode=append"]  # its node lost: it starts again, and writes its new address
    return Template((TEMPLATES / "lighthouse.sbatch").read_text()).substitute(
        sbatch_lines="\n".join(f"#SBATCH {line}" for line in lines), setup_lines="\n".join(options.setup),
        python=shlex.quote(options.python), recipe_args=" ".join(shlex.quote(a) for a in [str(recipe), *overrides]),
        address_file=shlex.quote(str(folder / ADDRESS)), groups_file=shlex.quote(str(folder / GROUPS_JOB)),
        poll_seconds=POLL)


def _groups(options: SlurmConfig, section, recipe: Path, overrides: List[str], run_dir: Path, name: str,
            workdir: Path) -> str:
    config = copy.deepcopy(options)
    config.sbatch = [*config.sbatch, f"--array=0-{section.groups - 1}"]
    config.output = config.output or str(run_dir / "slurm" / "%A_%a.out")
    address = shlex.quote(str(run_dir / "slurm" / ADDRESS))
    setup = [f"# replica group $SLURM_ARRAY_TASK_ID of {section.groups}: its index, its own run folder, the lighthouse",
             "export REPLICA_GROUP_ID=$SLURM_ARRAY_TASK_ID"]
    if not section.lighthouse:
        setup += [f"for waited in $(seq {ADDRESS_WAIT}); do [ -s {address} ] && break; sleep 1; done",
                  f'[ -s {address} ] || {{ echo "launcher: no lighthouse address in {address} after {ADDRESS_WAIT} s: '
                  f'is the lighthouse job running?" >&2; exit 2; }}',
                  f"export TORCHFT_LIGHTHOUSE=$(cat {address})"]
    setup += [f"# a group that fails (not a mistake, exit 2) is requeued, up to {REQUEUES} restarts: it rejoins the "
              f"live groups",
              f"trap 'code=$?; if [ $code -ne 0 ] && [ $code -ne 2 ] && [ \"${{SLURM_RESTART_COUNT:-0}}\" -lt "
              f"{REQUEUES} ]; then scontrol requeue \"${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}\"; fi' EXIT"]
    config.setup = [*config.setup, *setup]
    arguments = " ".join(shlex.quote(a) for a in [str(recipe), *overrides])
    arguments += " " + shlex.quote(f"run_dir={run_dir}/group_") + "$SLURM_ARRAY_TASK_ID"
    return render(config, recipe, overrides, run_dir, name, workdir, arguments=arguments)


def submit(lighthouse: str, groups: str, run_dir: Path, count: int) -> int:
    """The lighthouse's job, then the groups' array once it has started; one line says both and their logs."""
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (ADDRESS, GROUPS_JOB):  # a former submission's: a group must not read the old lighthouse's address
        (folder / stale).unlink(missing_ok=True)
    after, said = [], ""
    if lighthouse:
        (folder / "lighthouse.sbatch").write_text(lighthouse)
        job = sbatch(folder / "lighthouse.sbatch")
        after, said = [f"--dependency=after:{job}"], f"lighthouse job {job} (log {folder / f'lighthouse-{job}.out'}), "
    (folder / "groups.sbatch").write_text(groups)
    try:
        array = sbatch(folder / "groups.sbatch", *after)
    except UserError:
        if lighthouse:  # it would serve no group until its time limit
            subprocess.run(["scancel", job], capture_output=True)
        raise
    (folder / GROUPS_JOB).write_text(f"{array}\n")
    print(f"submitted {said}replica groups 0 to {count - 1} as job array {array} (logs {folder}/{array}_<group>.out); "
          f"scripts in {folder}")
    return 0
