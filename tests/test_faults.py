"""Faults: a killed worker, a rank that raises. Nothing is lost, nothing hangs."""

import random
import subprocess
import time

import pytest

from tests.conftest import REPO, assert_same_weights
from tests.test_strategies import RECIPE, TORCHRUN, run

COMMON = [*RECIPE, "checkpoint.every=10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whole")
    run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "launcher", *COMMON, f"run_dir={folder}"])
    return folder / "model.pt"


@pytest.mark.parametrize("at", random.Random(5).sample(range(2, 40), 3))
def test_sigkilled_worker_restarts_and_finishes_exactly(tmp_path, uninterrupted, at):
    """SIGKILL one worker at a random step (seeded: the steps are in the test id); torchrun restarts both."""
    dies = f"model={{_target_: tests.components.DiesOnce, at: {at}, rank: 1, how: kill}}"
    done = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "-m", "launcher", *COMMON,
                dies, f"run_dir={tmp_path}"])
    if at > 10:
        assert f"resumed from {tmp_path / 'checkpoints' / f'step_{(at - 1) // 10 * 10}'}" in done.stdout
    assert_same_weights(uninterrupted, tmp_path / "model.pt")


def test_a_rank_that_raises_takes_the_others_down_quickly(tmp_path):
    dies = "model={_target_: tests.components.DiesOnce, at: 15, rank: 1, how: raise}"
    started = time.time()
    done = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "launcher", *COMMON, dies,
                           f"run_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and time.time() - started < 60
    error = "RuntimeError: rank 1 broke at forward 15"
    ours = [l for l in done.stderr.splitlines() if l.endswith(error)]
    assert ours == [f"[rank1]: {error}"], done.stderr[-3000:]  # once, prefixed by its rank


def test_a_crash_inside_a_save_never_loses_the_newest_complete_checkpoint(tmp_path):
    """Three seeded instants (python -m tests.save_crash --trials 20 is the stress run)."""
    from tests.save_crash import count_events, run, trial

    assert run(tmp_path / "reference").returncode == 0
    total = count_events(tmp_path)
    for kill_at in random.Random(0).sample(range(1, total + 1), 3):
        assert trial(tmp_path, kill_at, tmp_path / "reference" / "model.pt").endswith("exact")
