"""SIGTERM and Ctrl-C: a checkpoint at the next step boundary, exit 143 or 130, and an exact resume."""

import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, SMALL, assert_same_weights, trained_here
from tests.pace import paced, until
from tests.rounding import assert_within_rounding, float64

# real torchrun / multi-process runs: python -m pytest -m 'not slow' skips them; their processes their own (workers
# are found as a pid's children: tests/conftest.py, own_processes)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_processes")]

# Slow enough (0.04 s a step) that a signal sent at step 10 finds the run going (70 steps, 2.8 s of sleep, still to
# run), few enough steps that the runs resumed to the end cost little. In float64, where tp x 2 ends within
# rounding of ddp x 2 on any CPU (tests/rounding.py).
MAX_STEPS = 80
SLOW = [*float64("tests.components.Slow"), "model.seconds=0.04", f"trainer.max_steps={MAX_STEPS}",
        "trainer.log_every=10", "checkpoint.every=null"]
SIGNALLED = ["recipes/quickstart.yaml", *SMALL, *SLOW]  # the recipe and overrides of every signalled run


def start(run_dir, *extra, env=None):
    return subprocess.Popen([sys.executable, "-m", "launcher", *SIGNALLED, f"run_dir={run_dir}", *extra], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def signal_after_first_log(proc, sig) -> str:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 10/"):
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=paced(60))
    return "".join(lines) + out + err


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "launcher",
            *SIGNALLED]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The run no signal stops, in one process: what every stopped and resumed one-process run ends as."""
    folder = tmp_path_factory.mktemp("whole")
    trained_here(*SIGNALLED, f"run_dir={folder}")  # (in the repository's folder, as conftest's in_this_process runs)
    return folder / "model.pt"


SPAWN = ["strategy=ddp", "nproc_per_node=2"]  # `python -m launcher` starts torchrun itself
TP = ["strategy=fsdp", "parallel.tp=2", "parallel.tp_plan={'0': colwise, '2': rowwise}"]
# The two-process runs that a signal stops: the command that starts them, the overrides, the signal.
STOPPED = {"torchrun SIGTERM": ("torchrun", [], signal.SIGTERM), "tp SIGTERM": ("torchrun", TP, signal.SIGTERM),
           "launcher SIGTERM": ("launcher", SPAWN, signal.SIGTERM), "launcher SIGINT": ("launcher", SPAWN, signal.SIGINT)}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Each two-process run of STOPPED, started as its test says (torchrun, or the launcher that starts torchrun)
    and signalled after step 10, a real process each; then one torchrun launch (tests/several_runs.py) resumes
    them all and runs `whole`, the run no signal stops under DDP x2: what every stopped and resumed two-process
    run ends as, bitwise. Each run's outcome is checked by its own test."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("ddp")
    stopped = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        for name, (how, extra, sig) in STOPPED.items():
            run_dir = root / name.replace(" ", "-")
            if how == "torchrun":
                proc = subprocess.Popen([*TORCHRUN, *extra, f"run_dir={run_dir}"], cwd=REPO, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
            else:
                proc = start(run_dir, *extra)
            output = signal_after_first_log(proc, sig)
            stopped[name] = {"run_dir": run_dir, "returncode": proc.returncode, "output": output,
                             "saved": sorted((run_dir / "checkpoints").glob("step_*"))}
        cases = {"whole": [*SIGNALLED, f"run_dir={root / 'whole'}"]}
        for name, (_, extra, _) in STOPPED.items():
            cases[name] = [*SIGNALLED, *extra, f"run_dir={stopped[name]['run_dir']}"]
        resumed = several(cases, root, timeout=300)
    assert [rank["whole"]["error"] for rank in resumed] == [None, None], resumed
    for name in STOPPED:
        stopped[name]["resumed"] = [rank[name] for rank in resumed]
    return root / "whole" / "model.pt", stopped


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_at_the_next_step_and_resume_is_exact(tmp_path, whole, sig, code):
    proc = start(tmp_path / "stopped")
    output = signal_after_first_log(proc, sig)
    assert proc.returncode == code, output
    saved = sorted((tmp_path / "stopped" / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and 10 <= int(saved[0].name[5:]) < MAX_STEPS, output
    assert f"stopped by {sig.name} after step {saved[0].name[5:]}: saved" in output
    assert not (tmp_path / "stopped" / "model.pt").exists()

    # the resume: what it reads is checked, not the process
    said = trained_here(*SIGNALLED, f"run_dir={tmp_path / 'stopped'}")
    assert f"resumed from {saved[0]}" in said
    assert_same_weights(whole, tmp_path / "stopped" / "model.pt")


def test_the_recipe_can_turn_the_save_off(tmp_path):
    proc = start(tmp_path, "checkpoint.on_signal=false")
    output = signal_after_first_log(proc, signal.SIGTERM)
    assert proc.returncode == 143, output
    assert not list(tmp_path.glob("checkpoints/step_*"))
    assert "not saved" in output


def test_sigterm_under_torchrun_two_ranks_agree_save_and_resume_exactly(ddp_runs):
    """torchrun forwards SIGTERM to both workers; they agree on one step (a host collective every 10
    steps), save once, and stop; resuming under torchrun finishes bitwise equal."""
    whole_ddp, stopped = ddp_runs
    run = stopped["torchrun SIGTERM"]
    output, saved = run["output"], run["saved"]
    assert run["returncode"] != 0, output
    assert len(saved) == 1 and int(saved[0].name[5:]) % 10 == 0, output
    assert f"stopped by SIGTERM after step {saved[0].name[5:]}: saved" in output
    assert [rank["error"] for rank in run["resumed"]] == [None, None], run["resumed"]
    assert_same_weights(whole_ddp, run["run_dir"] / "model.pt")


def test_sigterm_under_tensor_parallel_saves_and_resumes_as_the_run_no_signal_stopped(ddp_runs):
    """The MLP's layers split over the two ranks (tp 2): they agree on a step, save its shards, and the resumed
    run ends as ddp x2's uninterrupted one, within float rounding (a split matmul sums in another order)."""
    whole_ddp, stopped = ddp_runs
    run = stopped["tp SIGTERM"]
    output, saved = run["output"], run["saved"]
    assert run["returncode"] != 0 and len(saved) == 1, output
    assert f"stopped by SIGTERM after step {saved[0].name[5:]}: saved" in output
    assert [rank["error"] for rank in run["resumed"]] == [None, None], run["resumed"]
    assert_within_rounding(whole_ddp, run["run_dir"] / "model.pt", MAX_STEPS)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_the_launcher_that_started_torchrun_exits_as_the_plain_path(ddp_runs, sig, code):
    """`python -m launcher ... strategy=ddp` runs torchrun in its own process: torchrun passes the signal on,
    the workers save once and stop, and the launcher exits 128+N without torchrun's SignalException."""
    whole_ddp, stopped = ddp_runs
    run = stopped[f"launcher {sig.name}"]
    output, saved = run["output"], run["saved"]
    assert run["returncode"] == code and "Traceback" not in output, output
    assert len(saved) == 1 and 10 <= int(saved[0].name[5:]) < MAX_STEPS, output
    assert f"stopped by {sig.name} after step {saved[0].name[5:]}: saved" in output
    resumed = run["resumed"]
    assert [rank["error"] for rank in resumed] == [None, None] and f"resumed from {saved[0]}" in resumed[0]["said"], resumed
    assert_same_weights(whole_ddp, run["run_dir"] / "model.pt")  # torchrun's own run: the same weights


@pytest.mark.parametrize("env, job", [
    ({"SLURM_JOB_ID": "41"}, "41"),
    ({"SLURM_JOB_ID": "57", "SLURM_ARRAY_JOB_ID": "50", "SLURM_ARRAY_TASK_ID": "7"}, "50_7"),  # the array task
])
def test_requeue_names_the_job_or_the_array_task(tmp_path, monkeypatch, env, job):
    from launcher.stopping import RequeueFailed, requeue

    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/called\n[ "$2" != refuse ] || {{ echo "Requested operation '
                    f'is presently disabled" >&2; exit 1; }}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert requeue(env) == f"requeued Slurm job {job}: it resumes from the checkpoint"
    assert (tmp_path / "called").read_text().split() == ["requeue", job]
    assert requeue({}) is None  # outside Slurm: nothing to requeue
    with pytest.raises(RequeueFailed, match="presently disabled. HINT: submit with --requeue"):
        requeue({"SLURM_JOB_ID": "refuse"})


@pytest.mark.parametrize("shown, requeued", [
    ("JobId=41 JobState=PENDING Reason=BeginTime Restarts=1", True),  # taken back: waiting again
    ("JobId=41 JobState=COMPLETING Restarts=1", True),  # restarted once more than this run (restart 0)
    ("JobId=41 JobState=RUNNING Restarts=0", False),  # still the same run: the requeue did not happen
    ("", False),
])
def test_a_requeue_whose_scontrol_the_requeue_killed_is_told_by_the_jobs_record(tmp_path, monkeypatch, shown, requeued):
    """In CI (a busy machine): slurmd ended the job's processes, scontrol among them, before slurmctld's answer
    reached it; `scontrol requeue` died by SIGTERM with no message, and the launcher said the requeue failed while
    the job was requeued and resumed."""
    from launcher.stopping import RequeueFailed, requeue

    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\n[ "$1" = requeue ] && kill -TERM $$\necho "{shown}"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    if requeued:
        assert requeue({"SLURM_JOB_ID": "41"}) == "requeued Slurm job 41: it resumes from the checkpoint"
    else:
        with pytest.raises(RequeueFailed, match="scontrol requeue 41 failed: no message"):
            requeue({"SLURM_JOB_ID": "41"})


def test_slurm_refusing_the_requeue_exits_4_with_the_checkpoint_saved(tmp_path):
    import os

    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "Requested operation is presently disabled" >&2\nexit 1\n')
    fake.chmod(0o755)
    env = {**os.environ, "SLURM_JOB_ID": "41", "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    proc = start(tmp_path / "run", env=env)
    output = signal_after_first_log(proc, signal.SIGTERM)
    assert proc.returncode == 4 and "Traceback" not in output, output  # EXIT_REQUEUE
    assert "launcher: scontrol requeue 41 failed: Requested operation is presently disabled" in output
    assert len(list((tmp_path / "run" / "checkpoints").glob("step_*"))) == 1


def test_workers_stop_and_save_when_the_launcher_that_started_them_is_killed(tmp_path):
    """kill -9 of `python -m launcher ... strategy=ddp` gives its workers no signal (torchrun starts them in
    sessions of their own): they saw that their parent was gone, agreed on a step, saved and ended, where
    they used to train on to the end, unsupervised."""
    import os
    import time

    proc = start(tmp_path, "strategy=ddp", "nproc_per_node=2", "trainer.max_steps=100000")
    for line in proc.stdout:
        if line.startswith("step 10/"):
            break
    workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid]
    assert len(workers) == 2, workers
    proc.kill()
    proc.wait(timeout=paced(10))
    deadline = until(60)
    while any(os.path.exists(f"/proc/{w}") and _state(w) != "Z" for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [w for w in workers if os.path.exists(f"/proc/{w}") and _state(w) != "Z"]
    for w in alive:
        os.kill(w, signal.SIGKILL)
    err = proc.stderr.read()
    assert not alive, err[-2000:]
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and 10 <= int(saved[0].name[5:]) < 100000, err[-2000:]
    assert f"the launcher that started this worker (pid {proc.pid}) is gone; stopping as on SIGTERM" in err


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"
