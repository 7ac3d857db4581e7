"""SIGTERM and Ctrl-C: a checkpoint at the next step boundary, exit 143 or 130, and an exact resume."""

import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, SMALL, assert_same_weights, launch

pytestmark = pytest.mark.slow  # real torchrun / multi-process runs: python -m pytest -m 'not slow' skips them

SLOW = ["model={_target_: tests.components.Slow, seconds: 0.01}", "trainer.max_steps=300", "trainer.log_every=10",
        "checkpoint.every=null"]


def start(run_dir, *extra, env=None):
    return subprocess.Popen([sys.executable, "-m", "launcher", "recipes/quickstart.yaml", *SMALL, *SLOW,
                             f"run_dir={run_dir}", *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def signal_after_first_log(proc, sig) -> str:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 10/"):
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=60)
    return "".join(lines) + out + err


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "launcher",
            "recipes/quickstart.yaml", *SMALL, *SLOW]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The run no signal stops, in one process: what every stopped and resumed one-process run ends as."""
    folder = tmp_path_factory.mktemp("whole")
    done = launch("recipes/quickstart.yaml", *SMALL, *SLOW, f"run_dir={folder}")
    assert done.returncode == 0, done.stderr[-2000:]
    return folder / "model.pt"


@pytest.fixture(scope="module")
def whole_ddp(tmp_path_factory):
    """The same under DDP x2 (torchrun): what every stopped and resumed two-process run ends as, bitwise."""
    folder = tmp_path_factory.mktemp("whole-ddp")
    done = subprocess.run([*TORCHRUN, f"run_dir={folder}"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder / "model.pt"


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_at_the_next_step_and_resume_is_exact(tmp_path, whole, sig, code):
    proc = start(tmp_path / "stopped")
    output = signal_after_first_log(proc, sig)
    assert proc.returncode == code, output
    saved = sorted((tmp_path / "stopped" / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and 10 <= int(saved[0].name[5:]) < 300, output
    assert f"stopped by {sig.name} after step {saved[0].name[5:]}: saved" in output
    assert not (tmp_path / "stopped" / "model.pt").exists()

    resumed = launch("recipes/quickstart.yaml", *SMALL, *SLOW, f"run_dir={tmp_path / 'stopped'}")
    assert resumed.returncode == 0 and f"resumed from {saved[0]}" in resumed.stdout
    assert_same_weights(whole, tmp_path / "stopped" / "model.pt")


def test_the_recipe_can_turn_the_save_off(tmp_path):
    proc = start(tmp_path, "checkpoint.on_signal=false")
    output = signal_after_first_log(proc, signal.SIGTERM)
    assert proc.returncode == 143, output
    assert not list(tmp_path.glob("checkpoints/step_*"))
    assert "not saved" in output


def test_sigterm_under_torchrun_two_ranks_agree_save_and_resume_exactly(tmp_path, whole_ddp):
    """torchrun forwards SIGTERM to both workers; they agree on one step (a host collective every 10
    steps), save once, and stop; resuming under torchrun finishes bitwise equal."""
    proc = subprocess.Popen([*TORCHRUN, f"run_dir={tmp_path / 'stopped'}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    output = signal_after_first_log(proc, signal.SIGTERM)
    assert proc.returncode != 0, output
    saved = sorted((tmp_path / "stopped" / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and int(saved[0].name[5:]) % 10 == 0, output
    assert f"stopped by SIGTERM after step {saved[0].name[5:]}: saved" in output
    done = subprocess.run([*TORCHRUN, f"run_dir={tmp_path / 'stopped'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_weights(whole_ddp, tmp_path / "stopped" / "model.pt")


def test_sigterm_under_tensor_parallel_saves_and_resumes_as_the_run_no_signal_stopped(tmp_path, whole_ddp):
    """The MLP's layers split over the two ranks (tp 2): they agree on a step, save its shards, and the resumed
    run ends as ddp x2's uninterrupted one, within float rounding (a split matmul sums in another order)."""
    import torch

    from tests.conftest import state_dict

    tp = ["strategy=fsdp", "parallel.tp=2", "parallel.tp_plan={'0': colwise, '2': rowwise}", f"run_dir={tmp_path}"]
    proc = subprocess.Popen([*TORCHRUN, *tp], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    output = signal_after_first_log(proc, signal.SIGTERM)
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert proc.returncode != 0 and len(saved) == 1, output
    assert f"stopped by SIGTERM after step {saved[0].name[5:]}: saved" in output
    done = subprocess.run([*TORCHRUN, *tp], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    a, b = state_dict(whole_ddp), state_dict(tmp_path / "model.pt")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_the_launcher_that_started_torchrun_exits_as_the_plain_path(tmp_path, whole_ddp, sig, code):
    """`python -m launcher ... strategy=ddp` runs torchrun in its own process: torchrun passes the signal on,
    the workers save once and stop, and the launcher exits 128+N without torchrun's SignalException."""
    spawn = ["strategy=ddp", "nproc_per_node=2"]
    proc = start(tmp_path / "stopped", *spawn)
    output = signal_after_first_log(proc, sig)
    assert proc.returncode == code and "Traceback" not in output, output
    saved = sorted((tmp_path / "stopped" / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and 10 <= int(saved[0].name[5:]) < 300, output
    assert f"stopped by {sig.name} after step {saved[0].name[5:]}: saved" in output
    resumed = launch("recipes/quickstart.yaml", *SMALL, *SLOW, *spawn, f"run_dir={tmp_path / 'stopped'}", timeout=180)
    assert resumed.returncode == 0 and f"resumed from {saved[0]}" in resumed.stdout, resumed.stderr[-2000:]
    assert_same_weights(whole_ddp, tmp_path / "stopped" / "model.pt")  # torchrun's own run: the same weights


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
    proc.wait(timeout=10)
    deadline = time.monotonic() + 60
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
