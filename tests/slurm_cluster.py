"""A real local Slurm cluster for tests: `from tests.slurm_cluster import slurm_cluster  # noqa: F401`.

The session-scoped `slurm_session` (registered once, in tests/conftest.py) runs `slurm/local/up.sh`
(quick when the cluster is already up), skips the test when that cannot work here (not root, or
apt-get cannot install Slurm), and yields a `SlurmCluster` whose helpers submit jobs and read their
state with the real client commands. Tests take `slurm_cluster`, which leaves the cluster as it found
it: the jobs a test leaves queued or running (an array task still exiting, a job the test gave up
on) are cancelled, and gone, before the next test submits. Two nodes are all there is: a job left
running would hold the next test's job in PENDING (Reason=Resources) until its time limit.

Daemons the session started are stopped at its end (`slurm/local/down.sh`); a cluster that was
already up (started by hand, or by another test run) is left as it was. The state folder is never
wiped: job ids restart at 1 when it is, and output files named after job ids would be reused. Tests
should write their outputs under their own `tmp_path`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.pace import paced, until

REPO = Path(__file__).resolve().parents[1]
UP = REPO / "slurm" / "local" / "up.sh"
DOWN = REPO / "slurm" / "local" / "down.sh"

FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE")

# `scontrol show job -o`: one line of Key=Value pairs; values may hold '=' (TRES=cpu=2,node=1) and,
# rarely, spaces (a job name), so a pair ends where whitespace is followed by the next `Key=`.
_PAIR = re.compile(r"([A-Za-z][\w:/]*)=(.*?)(?=\s+[A-Za-z][\w:/]*=|\s*$)")


@dataclass
class SlurmCluster:
    env: dict
    state: Path
    preexisting: set = field(default_factory=set)  # job ids queued before this session: left alone

    def run(self, *cmd: str, timeout: float = 30, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; raise with its output when it fails."""
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=paced(timeout), **kwargs)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc

    def sbatch(self, script_path, *args: str, cwd=None) -> int:
        """Submit a batch script (from its own folder unless `cwd` says otherwise); return the job id."""
        script = Path(script_path)
        proc = self.run("sbatch", *args, str(script), cwd=cwd or script.parent)
        match = re.search(r"Submitted batch job (\d+)", proc.stdout)
        assert match, f"sbatch said: {proc.stdout}{proc.stderr}"
        return int(match.group(1))

    def job_state(self, job_id: int) -> dict:
        """`scontrol show job -o JOB` as a dict: JobState, ExitCode, Restarts, Reason, NodeList, ..."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
        return dict(_PAIR.findall(out.splitlines()[0] if out else ""))

    def wait(self, job_id: int, states=FINISHED, timeout: float = 120) -> dict:
        """Poll every 0.3 s until the job's JobState is one of `states`; return the job's state."""
        timeout = paced(timeout)
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_state(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not in {states} after {timeout} s: "
                                     f"JobState={info.get('JobState')} Reason={info.get('Reason')}\n{info}")
            time.sleep(0.3)

    def release(self, job_id: int, timeout: float = 30) -> None:
        """Start a requeued job now instead of after its ~120 s hold (Reason=BeginTime).

        A job requeued while running passes COMPLETING and REQUEUED first; wait until it is PENDING,
        since StartTime can only be changed on a pending job. Then wait until the clock is in a later
        second than the requeue (the job's SubmitTime): slurmd revokes the job's credential when the
        first run is killed, with one-second resolution, and a rerun launched on the same node within
        that second fails at once ("Killing non-startable batch JobId=N: Job credential revoked",
        JobState=FAILED, ExitCode=1:0). `StartTime=now+1` avoids that too, but the main scheduler
        does not wake up for it and the backfill scheduler starts the job up to 30 s later."""
        info = self.wait(job_id, states=("PENDING",), timeout=timeout)
        requeued = time.mktime(time.strptime(info["SubmitTime"], "%Y-%m-%dT%H:%M:%S"))
        time.sleep(max(0.0, requeued + 1.05 - time.time()))
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def queued(self) -> set:
        """Ids of the jobs squeue still lists (pending, running, completing)."""
        out = self.run("squeue", "-h", "-o", "%i", check=False).stdout
        return {line.strip() for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="session")
def slurm_session():
    if shutil.which("bash") is None:
        pytest.skip("slurm cluster: no bash")
    try:
        proc = subprocess.run(["bash", str(UP)], capture_output=True, text=True, timeout=paced(180))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"slurm/local/up.sh did not finish in 180 s:\n{e.stdout or ''}{e.stderr or ''}")
    said = (proc.stdout + proc.stderr).strip()
    if proc.returncode == 3:
        pytest.skip(f"slurm cluster needs root: {proc.stderr.strip()}")
    if proc.returncode == 4:
        pytest.skip("slurm cluster: apt-get could not install slurmctld slurmd slurm-client munge:\n"
                    + "\n".join(said.splitlines()[-8:]))
    if proc.returncode != 0:
        pytest.fail(f"slurm/local/up.sh exited {proc.returncode}:\n{said}")
    match = re.search(r"^export SLURM_CONF=(.+)$", proc.stdout, re.M)
    assert match, f"slurm/local/up.sh printed no SLURM_CONF line:\n{said}"
    conf = Path(match.group(1).strip())
    env = {**os.environ, "SLURM_CONF": str(conf)}
    env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
    cluster = SlurmCluster(env=env, state=conf.parent)
    cluster.preexisting = cluster.queued()
    started = "up.sh: starting slurmctld" in proc.stdout  # else it was up before this session
    yield cluster
    # Cancel what this session left queued or running (jobs submitted by the launcher included),
    # but not jobs that were there before it; stop the daemons if this session started them.
    leftover = sorted(cluster.queued() - cluster.preexisting)
    if leftover:
        cluster.run("scancel", "--full", *leftover, check=False)
    if started:
        subprocess.run(["bash", str(DOWN)], capture_output=True, text=True, timeout=paced(120))


@pytest.fixture
def slurm_cluster(slurm_session):
    yield slurm_session  # the Slurm tests run one at a time, on one worker (tests/conftest.py)
    left = sorted(slurm_session.queued() - slurm_session.preexisting)
    if left:
        slurm_session.run("scancel", "--full", *left, check=False)
        deadline = until(60)
        while slurm_session.queued() & set(left) and time.monotonic() < deadline:
            time.sleep(0.3)
