"""A fault-tolerant run on a real Slurm cluster (slurm/local/): python -m launcher.slurm submit --replica-groups 2
queues the lighthouse as a job and the groups as a job array; a group killed mid-step requeues its own task, and
started again it copies the live group's state and trains on with it."""

import re
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, assert_same_weights
from tests.ft_runs import PACED, RECIPE, TIMEOUTS, steps, redone
from tests.pace import paced, until
from tests.slurm_cluster import slurm_cluster  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
pytest.importorskip("torchft", reason="torchft's wheels are Linux x86-64 only (the dev extra installs it there)")

KILLED_AT = 20  # group 1 kills itself in the forward of this step (tests/components_ft.py), on its first start


def test_replica_groups_as_jobs_a_killed_group_is_requeued_and_rejoins_live(slurm_cluster, tmp_path):  # noqa: F811
    # 40 ms a step for 800 steps: group 0 still trains when group 1's task, requeued, has started again
    done = subprocess.run([sys.executable, "-m", "launcher.slurm", "submit", *RECIPE, *TIMEOUTS, *PACED[:3],
                           "trainer.max_steps=800", "trainer.log_every=50", f"run_dir={tmp_path}", "--replica-groups",
                           "2", f"--python={sys.executable}", "--time=5"],
                          cwd=REPO, env={**slurm_cluster.env, "FT_TEST_DIE": f"1:{KILLED_AT}"}, capture_output=True,
                          text=True, timeout=paced(60))
    assert done.returncode == 0, done.stderr
    said = re.fullmatch(r"submitted lighthouse job (\d+) \(log \S+\), replica groups 0 to 1 as job array (\d+) "
                        r"\(logs \S+\); scripts in (\S+)\n", done.stdout)
    assert said and said.group(3) == str(tmp_path / "slurm"), done.stdout
    lighthouse, array = said.group(1), said.group(2)
    deadline = until(120)
    while slurm_cluster.job_state(f"{array}_1").get("Restarts") != "1":  # killed, its task requeues itself
        assert time.monotonic() < deadline, slurm_cluster.job_state(f"{array}_1")
        time.sleep(0.3)
    slurm_cluster.release(f"{array}_1", timeout=60)  # started now, not after Slurm's hold of a requeued job (2 min)
    for g in (0, 1):
        info = slurm_cluster.wait(f"{array}_{g}", timeout=300)
        log = (tmp_path / "slurm" / f"{array}_{g}.out").read_text()
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{log[-3000:]}"
    info = slurm_cluster.wait(lighthouse, timeout=60)  # it sees no group left in the queue, and stops
    served = (tmp_path / "slurm" / f"lighthouse-{lighthouse}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{served[-3000:]}"
    assert "launcher.ft: lighthouse stopped" in served
    live, back = ((tmp_path / "slurm" / f"{array}_{g}.out").read_text() for g in (0, 1))
    assert redone(KILLED_AT, live) and "(restart 0)" in live and "(restart 1)" not in live
    assert steps(live.splitlines()) == list(range(50, 801, 50))  # its log steps, in order, none twice
    recovered = int(re.search(r"recovered live from a live group at step (\d+) \(.*no checkpoint read\)", back).group(1))
    assert "(restart 1)" in back and KILLED_AT < recovered < 800
    assert slurm_cluster.job_state(f"{array}_1")["Restarts"] == "1"
    assert_same_weights(tmp_path / "group_0" / "model.pt", tmp_path / "group_1" / "model.pt")


def test_a_groups_array_sbatch_refuses_cancels_the_lighthouse_job_it_would_wait_for(slurm_cluster, tmp_path):  # noqa: F811
    # The local cluster's MaxArraySize is Slurm's default, 1001: an array of 1002 tasks is refused by sbatch
    # after the lighthouse's job was queued. Left there, it would serve no group until its time limit.
    before = slurm_cluster.queued()
    done = subprocess.run([sys.executable, "-m", "launcher.slurm", "submit", *RECIPE, f"run_dir={tmp_path}",
                           "--replica-groups", "1002", f"--python={sys.executable}", "--time=5"],
                          cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=paced(60))
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"launcher: sbatch refused {tmp_path / 'slurm' / 'groups.sbatch'}: "), line
    script = (tmp_path / "slurm" / "lighthouse.sbatch").read_text()
    assert "--lighthouse" in script
    deadline = until(30)
    while slurm_cluster.queued() - before:  # the lighthouse's job, cancelled
        assert time.monotonic() < deadline, slurm_cluster.queued() - before
        time.sleep(0.3)
