"""A rank that stops answering: the others end within dist_timeout with one line naming the step and the
collective, instead of hanging; a rerun resumes exactly."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from launcher.observe import hang
from tests.conftest import REPO, assert_same_weights
from tests.pace import paced, until
from tests.several_runs import several
from tests.test_strategies import RECIPE

pytestmark = pytest.mark.usefixtures("own_processes")  # a rank found among the agent's descendants and stopped

# Slow enough (0.05 s a step) that rank 1 is stopped well before the end (60 steps, 3 s of sleep, after step_20).
SLOW = [*RECIPE, "checkpoint.every=10", "trainer.max_steps=80", "model={_target_: tests.components.Slow, seconds: 0.05}"]


def descendants(pid: int) -> list:
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return children + [d for c in children for d in descendants(c)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


def rank_of(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        variables = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return variables.get(b"RANK", b"?").decode()


@pytest.mark.slow
def test_a_stopped_rank_ends_the_others_with_one_line_and_a_rerun_resumes_exactly(tmp_path):
    # As a user types it: the launcher starts torchrun (a plain torchrun adds its own agent's traceback).
    command = [sys.executable, "-m", "launcher", *SLOW, "strategy=ddp", "nproc_per_node=2", f"run_dir={tmp_path / 'run'}"]
    # 5 s on a quiet machine: a busy one's healthy collectives wait longer than that for a rank the CPU is not on
    timeout = round(paced(5))
    agent = subprocess.Popen([*command, f"dist_timeout={timeout}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = until(120)
    while not (tmp_path / "run" / "checkpoints" / "step_20").exists():
        assert time.monotonic() < deadline and agent.poll() is None, agent.communicate()
        time.sleep(0.1)
    ranks = {rank_of(p): p for p in descendants(agent.pid) if rank_of(p) in ("0", "1")}
    stopped = ranks["1"]
    os.kill(stopped, signal.SIGSTOP)
    at = time.monotonic()
    said = []
    try:
        for line in agent.stderr:  # rank 0's line comes within the timeout (torchrun would then wait 30 s
            said.append(line)      # for the frozen rank to take SIGTERM before it SIGKILLs it: done here)
            if line.startswith("[rank 0] launcher:"):
                break
        waited, gone = time.monotonic() - at, until(60)
        while alive(ranks["0"]) and time.monotonic() < gone:  # rank 0 ends, and torchrun sees its exit code
            time.sleep(0.1)
    finally:
        os.kill(stopped, signal.SIGKILL)
    out, err = agent.communicate(timeout=paced(60))
    err = "".join(said) + err
    assert waited < timeout + paced(15), err[-3000:]  # dist_timeout, not the default's 600 s
    assert agent.returncode == 6, err[-3000:]  # rank 0's exit code
    ours = [line for line in err.splitlines() if line.startswith("[rank") and "launcher:" in line]
    assert len(ours) == 1, err[-3000:]  # the stopped rank says nothing
    assert ours[0].startswith("[rank 0] launcher: step "), ours
    assert f"did not finish within dist_timeout={timeout}s: another rank stopped, hung or died" in ours[0]
    assert "the gradient all-reduce of backward" in ours[0] or "torch.distributed." in ours[0]
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "model.pt").exists()

    # The same recipe, dist_timeout back to its default: the rerun resumes and ends exactly as the run no rank
    # stopped. Neither is about the launch: they share one (tests/several_runs.py), DDP x2 as the launcher starts.
    rerun, whole = [*SLOW, "strategy=ddp", "nproc_per_node=2"], tmp_path / "whole"
    again = several({"rerun": [*rerun, f"run_dir={tmp_path / 'run'}"], "whole": [*rerun, f"run_dir={whole}"]}, tmp_path)
    assert [rank[name]["error"] for rank in again for name in ("rerun", "whole")] == [None] * 4, again
    assert "resumed from" in again[0]["rerun"]["said"]
    assert_same_weights(whole / "model.pt", tmp_path / "run" / "model.pt")


def test_the_collective_is_named_from_where_the_wait_was(tmp_path):
    """A real gloo timeout in this process: a world of two whose second rank never comes."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        def in_all_reduce():
            dist.all_reduce(torch.ones(1))
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")

        try:
            in_all_reduce()
        except RuntimeError as e:
            assert hang.timed_out(e)
            # raised here, not inside torch: named by the nearest torch frame or as a collective
            assert hang.operation(e) == "a collective"
    finally:
        dist.destroy_process_group()
    try:
        torch.ones(2, requires_grad=True).sum().backward(torch.ones(3))
    except RuntimeError as e:
        assert not hang.timed_out(e) and hang.operation(e) == "the gradient all-reduce of backward"
    line = str(hang.report(RuntimeError("Timed out waiting 5000ms"), 7, 5, None))
    assert line.startswith("step 7: a collective did not finish within dist_timeout=5s")
    assert str(hang.report(RuntimeError("x"), None, 600, "/r/flight_recorder")).startswith(
        "before the first step: a collective did not finish within dist_timeout=600s")


def test_dist_timeout_must_be_positive(tmp_path, capsys):
    """The command line's own path (launcher.cli.main), in this process: a mistake, exit 2, one line."""
    from launcher.cli import main

    code, said = main(["recipes/quickstart.yaml", f"run_dir={tmp_path}", "dist_timeout=0"]), capsys.readouterr().err
    assert code == 2 and "dist_timeout" in said and len(said.strip().splitlines()) == 1
