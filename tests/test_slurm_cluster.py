"""The local Slurm cluster of slurm/local/ works: multi-node jobs run, requeued jobs run again."""

import time

import pytest

from tests.pace import until
from tests.slurm_cluster import slurm_cluster  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_two_node_job_completes(slurm_cluster, tmp_path):  # noqa: F811
    script = tmp_path / "hostname.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --time=1\n"
                      "srun hostname\n")
    out = tmp_path / "hostname.out"
    job = slurm_cluster.sbatch(script, f"--output={out}")

    info = slurm_cluster.wait(job, timeout=30)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info
    assert info["NodeList"] == "n[1-2]", info
    lines = out.read_text().splitlines()
    assert len(lines) == 2, lines


def test_requeued_job_runs_again_with_restart_count(slurm_cluster, tmp_path):  # noqa: F811
    script = tmp_path / "requeue.sh"
    # The first run waits to be requeued; the second sees SLURM_RESTART_COUNT=1 and ends at once.
    script.write_text('#!/bin/bash\n#SBATCH --time=2\n'
                      'echo "SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"\n'
                      '[ "${SLURM_RESTART_COUNT:-0}" = 0 ] && sleep 120\n'
                      'exit 0\n')
    out = tmp_path / "requeue.out"
    # append: the rerun would otherwise truncate the first run's output.
    job = slurm_cluster.sbatch(script, "--requeue", "--open-mode=append", f"--output={out}")

    slurm_cluster.wait(job, states=("RUNNING",), timeout=30)
    deadline = until(30)
    while "SLURM_RESTART_COUNT=0" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, "the first run never wrote its output"
        time.sleep(0.2)

    slurm_cluster.run("scontrol", "requeue", str(job))
    slurm_cluster.release(job)
    info = slurm_cluster.wait(job, timeout=30)

    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), info
    # Between the two runs slurmstepd adds "*** JOB N ON n1 CANCELLED AT ... DUE TO JOB REQUEUE ***".
    said = [line for line in out.read_text().splitlines() if line.startswith("SLURM_RESTART_COUNT=")]
    assert said == ["SLURM_RESTART_COUNT=0", "SLURM_RESTART_COUNT=1"], out.read_text()
