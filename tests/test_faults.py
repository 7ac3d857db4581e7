"""Faults: a killed worker, a rank that raises. Nothing is lost, nothing hangs."""

import random
import subprocess
import time

import pytest
import torch

from tests.conftest import REPO, assert_same_weights, state_dict
from tests.pace import paced, until
from tests.save_crash import killed as killed_inside_a_save  # its trial up to the resume
from tests.test_strategies import RECIPE, TORCHRUN, run

# real torchrun / multi-process runs: python -m pytest -m 'not slow' skips them; their processes their own (workers
# are found as a pid's children: tests/conftest.py, own_processes)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_processes")]

COMMON = [*RECIPE, "checkpoint.every=10"]
# The node-loss runs: slow enough (0.05 s a step) that the nodes are lost well before the end (3 s of sleep and
# 60 steps after step_20), few enough steps that a rerun costs little.
SLOW = ["model={_target_: tests.components.Slow, seconds: 0.05}", "trainer.max_steps=80"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The runs no fault stops, what each killed and resumed run must end as bitwise: ddp x2 and fsdp x2 of
    COMMON, and ddp x2 of the node-loss recipe. Their training is not what these tests check, so they share
    one torchrun launch (tests/several_runs.py); the node-loss reference runs as two processes of one node,
    which are ranks 0 and 1 of a world of two as the two nodes' are (the same shards, the same all-reduces)."""
    from tests.several_runs import several

    folder = tmp_path_factory.mktemp("whole")
    cases = {"ddp": [*COMMON, f"run_dir={folder / 'ddp'}"],
             "fsdp": [*COMMON, "strategy=fsdp", f"run_dir={folder / 'fsdp'}"],
             "two-nodes": [*COMMON, *SLOW, f"run_dir={folder / 'two-nodes'}"]}
    for rank, results in enumerate(several(cases, folder)):
        for name, result in results.items():
            assert result["error"] is None, f"rank {rank}, {name}: {result}"
    return {name: folder / name / "model.pt" for name in cases}


def _killed_at(steps):
    """Where the worker dies in each attempt: at the step, counted from the checkpoint the attempt resumes."""
    at, resumed = [], 0
    for step in steps:
        at.append(step - resumed)
        resumed = (step - 1) // 10 * 10  # the newest checkpoint before the step (one every 10)
    return at


@pytest.mark.parametrize("steps", [sorted(random.Random(5).sample(range(2, 40), 3))],
                         ids=lambda steps: "-".join(map(str, steps)))
def test_sigkilled_worker_restarts_and_finishes_exactly(tmp_path, uninterrupted, steps):
    """SIGKILL one worker at random steps (seeded: the steps are in the test id), once in each of torchrun's
    attempts: torchrun restarts both each time, each attempt resumes from the newest checkpoint before its
    kill, and the last one ends bitwise as the run no kill stopped."""
    dies = f"model={{_target_: tests.components.DiesInAttempts, at: {_killed_at(steps)}, rank: 1, how: kill}}"
    done = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", f"--max-restarts={len(steps)}", "-m", "launcher",
                *COMMON, dies, f"run_dir={tmp_path}"], timeout=180 + 120 * len(steps))  # each restart's start
    for step in steps:
        if step > 10:
            assert f"resumed from {tmp_path / 'checkpoints' / f'step_{(step - 1) // 10 * 10}'}" in done.stdout
    assert done.stdout.count("resumed from") == sum(step > 10 for step in steps), done.stdout  # one per kill
    assert_same_weights(uninterrupted["ddp"], tmp_path / "model.pt")


def test_a_sigkilled_fsdp_worker_restarts_and_resumes_its_shards_exactly(tmp_path, uninterrupted):
    """fsdp x2: the restarted ranks read their shards of the newest checkpoint (one seeded instant)."""
    fsdp = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "launcher", *COMMON, "strategy=fsdp"]
    at = random.Random(7).randrange(12, 40)
    dies = f"model={{_target_: tests.components.DiesOnce, at: {at}, rank: 1, how: kill}}"
    done = run([*fsdp[:3], "--max-restarts=1", *fsdp[3:], dies, f"run_dir={tmp_path / 'killed'}"])
    assert f"resumed from {tmp_path / 'killed' / 'checkpoints' / f'step_{(at - 1) // 10 * 10}'}" in done.stdout
    assert_same_weights(uninterrupted["fsdp"], tmp_path / "killed" / "model.pt")


def test_a_rank_that_raises_takes_the_others_down_quickly(tmp_path):
    dies = "model={_target_: tests.components.DiesOnce, at: 15, rank: 1, how: raise}"
    # quickly: within a minute on a quiet machine (the rank left waiting would wait for dist_timeout)
    done = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "launcher", *COMMON, dies,
                           f"run_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=paced(60))
    assert done.returncode != 0
    error = "RuntimeError: rank 1 broke at forward 15"
    ours = [l for l in done.stderr.splitlines() if l.endswith(error)]
    assert ours == [f"[rank1]: {error}"], done.stderr[-3000:]  # once, prefixed by its rank


def test_the_rank_that_raised_first_is_the_last_error_on_the_screen(tmp_path):
    """torchrun looking at its workers every 3 s: rank 0's collective fails first ("Connection closed by
    peer") and it used to print a second full traceback after rank 1's, the cause. It now stops without
    one, and torchrun's report names rank 1 as the root cause."""
    dies = "model={_target_: tests.components.DiesOnce, at: 15, rank: 1, how: raise}"
    done = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor-interval=3", "-m", "launcher",
                           *COMMON, dies, f"run_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=paced(120))
    assert done.returncode != 0
    errors = [l for l in done.stderr.splitlines() if l.startswith("[rank") and "Error: " in l]
    assert errors == ["[rank1]: RuntimeError: rank 1 broke at forward 15"], done.stderr[-3000:]
    assert "Connection closed by peer" not in done.stderr, done.stderr[-3000:]
    root = done.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root, done.stderr[-3000:]


# The save-crash runs: 20 steps of tests.save_crash's recipe, a save every 5 steps, 2 kept: four saves, the
# last two deleting the oldest, so that a kill lands in any kind of event (a chunk, an fsync, a rename, a deletion).
SAVES = ["trainer.max_steps=20"]


def _resumed_exactly(said, run_dir, newest, reference, kill_at):
    if newest is not None:
        assert f"resumed from {newest}" in said, said[-2000:]
    final, expected = state_dict(run_dir / "model.pt"), state_dict(reference)
    assert all(torch.equal(final[k], expected[k]) for k in expected), f"resume after a kill at {kill_at} is not exact"


def test_a_crash_inside_a_save_never_loses_the_newest_complete_checkpoint(tmp_path, capsys):
    """Three seeded instants, the last inside a save written in the background (checkpoint.async_save: the
    same files, so the same events, on rank 0's writer thread). python -m tests.save_crash --trials 20
    [--async] are the stress runs. Each killed run is a real process; its resume (what is checked is the
    folder it reads, not the process) runs in this one, where torch is imported already."""
    from launcher.cli import main
    from tests.save_crash import ASYNC, RECIPE, reference

    total = reference(tmp_path, SAVES)[0]
    for i, kill_at in enumerate(random.Random(0).sample(range(1, total + 1), 3)):
        extra = SAVES + (ASYNC if i == 2 else [])
        run_dir, newest = killed_inside_a_save(tmp_path, kill_at, extra)
        capsys.readouterr()
        assert main([*RECIPE, *extra, f"run_dir={run_dir}"]) == 0
        _resumed_exactly(capsys.readouterr().out, run_dir, newest, tmp_path / "reference" / "model.pt", kill_at)


def test_a_crash_inside_a_sharded_save_never_loses_the_newest_complete_checkpoint(tmp_path):
    """fsdp x2, one seeded instant per rank: rank 1 killed inside a synchronous save, rank 0 inside one written
    in the background (python -m tests.save_crash --trials 20 --fsdp [--async] are the stress runs). The
    background save writes the same files and weights, so one reference and one count serve both. Each kill is
    a real torchrun launch; the two resumes share one (tests/several_runs.py)."""
    from tests.save_crash import ASYNC, RECIPE, SHARDED, reference
    from tests.several_runs import several

    totals = reference(tmp_path, SHARDED + SAVES)
    killed = {}
    for rank, extra in ((1, SHARDED + SAVES), (0, SHARDED + SAVES + ASYNC)):
        kill_at = random.Random(rank).randrange(1, totals[rank] + 1)
        killed[f"rank {rank} at {kill_at}"] = (kill_at, extra, *killed_inside_a_save(tmp_path, kill_at, extra, rank))
    resumed = several({name: [*RECIPE, *extra, f"run_dir={run_dir}"] for name, (_, extra, run_dir, _) in killed.items()},
                      tmp_path)
    for name, (kill_at, _, run_dir, newest) in killed.items():
        assert [r[name]["error"] for r in resumed] == [None, None], resumed
        _resumed_exactly(resumed[0][name]["said"], run_dir, newest, tmp_path / "reference" / "model.pt", kill_at)


def nodes(run_dir, extra):
    """Two torchrun agents standing for two nodes, one process each. Node 0 starts first and hosts the
    rendezvous store; node 1 joins once the store listens."""
    import socket

    from tests.test_strategies import free_port

    port = free_port()
    command = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=nodeloss", "-m", "launcher", *COMMON, *extra,
               f"run_dir={run_dir}"]
    started = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)]
    deadline = until(60)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "node 0's rendezvous store never listened"
            time.sleep(0.1)
    started.append(subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True))
    return started


@pytest.mark.parametrize("lost", [0, 1], ids=["the-rendezvous-host", "the-other-node"])
def test_node_loss_the_survivor_exits_and_a_rerun_resumes_exactly(tmp_path, uninterrupted, lost):
    """Two torchrun agents stand for two nodes; one node is lost whole (agent and worker SIGKILLed)."""
    import os
    import signal

    first = nodes(tmp_path, SLOW)
    deadline = until(120)
    while not list(tmp_path.glob("checkpoints/step_20")):
        assert time.monotonic() < deadline and all(n.poll() is None for n in first)
        time.sleep(0.1)
    # The node whole: its agent and its worker (torchrun starts workers in sessions of their own).
    workers = subprocess.run(["pgrep", "-P", str(first[lost].pid)], capture_output=True, text=True).stdout.split()
    for pid in [first[lost].pid, *map(int, workers)]:
        os.kill(pid, signal.SIGKILL)
    survivor = first[1 - lost]
    survivor.communicate(timeout=paced(60))
    assert survivor.returncode != 0
    assert not (tmp_path / "model.pt").exists()
    # The node is back (or the job is resubmitted): the same command resumes from the newest checkpoint.
    again = nodes(tmp_path, SLOW)
    outputs = [n.communicate(timeout=paced(180))[0] for n in again]
    assert [n.returncode for n in again] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert any("resumed from" in o for o in outputs)
    assert_same_weights(uninterrupted["two-nodes"], tmp_path / "model.pt")
