"""sbatch itself: a script written into the run folder and submitted, its job's id read back. Below both the
command (__main__.py) and the replica groups' jobs (groups.py), which each submit through it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from launcher.errors import UserError


def submit(script: str, run_dir: Path, name: str = "job.sbatch", what: str = "job", logs: str = "{job}.out") -> int:
    """Write the script into <run_dir>/slurm/ and sbatch it; one line says the job and where its logs go."""
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(script)
    job = sbatch(path)
    print(f"submitted {what} {job}: script {path}, logs {folder / logs.format(job=job)}")
    return 0


def sbatch(path: Path, *options: str) -> str:
    """`sbatch [options] path`: the job's id."""
    if shutil.which("sbatch") is None:
        raise UserError("sbatch is not on PATH. HINT: submit from a Slurm login node, or start the local "
                        "cluster (bash slurm/local/up.sh) and export SLURM_CONF as it says")
    done = subprocess.run(["sbatch", "--parsable", *options, str(path)], capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"sbatch refused {path}: {reason}")
    return done.stdout.strip().split(";")[0]
