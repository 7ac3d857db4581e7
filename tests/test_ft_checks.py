"""Fault tolerance's checks on what groups share (tests/ft_runs.py's runs: python -m launcher.ft, a lighthouse on
loopback, groups of one process): a checkpoint.dir outside the run folder, and the recipe every group is checked
against before it averages anything, however it starts. Few steps each: what is checked is decided before the first."""

import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import REPO, assert_same_weights, trained_here
from launcher.ft import same_recipe
from tests.ft_runs import GROUPS, RECIPE, Run, steps, unprefixed, without_die

pytestmark = pytest.mark.slow
pytest.importorskip("torchft", reason="torchft's wheels are Linux x86-64 only (the dev extra installs it there)")


def test_groups_sharing_a_checkpoint_dir_each_keep_their_checkpoints_in_a_place_of_their_own(tmp_path):
    shared = tmp_path / "shared"  # a folder outside the run folder: locked by its own .lock, as an S3 prefix is
    run = Run(*RECIPE, *GROUPS, "trainer.max_steps=4", "checkpoint.every=2", f"checkpoint.dir={shared}",
              f"run_dir={tmp_path / 'ft'}")
    assert run.finish() == 0, run.text()[-3000:]
    for g in (0, 1):
        assert steps(run.of(g)) == [1, 2, 3, 4]  # both trained every step: neither was refused by the other's lock
        assert f"checkpoint.dir: group {g} keeps its checkpoints in {shared}/group_{g}" in "".join(run.of(g))
        kept = yaml.safe_load((tmp_path / "ft" / f"group_{g}" / "recipe.yaml").read_text())["checkpoint"]["dir"]
        assert kept == f"{shared}/group_{g}"  # where python -m launcher.export RUN_DIR finds them
    saved = {g: sorted(p.name for p in (shared / f"group_{g}").glob("step_*")) for g in (0, 1)}
    assert saved == {0: ["step_2", "step_4"], 1: ["step_4"]}  # the periodic one by the lowest live group alone
    assert_same_weights(tmp_path / "ft" / "group_0" / "model.pt", tmp_path / "ft" / "group_1" / "model.pt")


def _lighthouse(tmp_path) -> tuple:
    """python -m launcher.ft --lighthouse alone, and its address once it serves (its file written)."""
    address = tmp_path / "lighthouse.address"
    server = subprocess.Popen([sys.executable, "-m", "launcher.ft", *RECIPE, *GROUPS, "--lighthouse",
                               f"--address-file={address}"], cwd=REPO, stdout=subprocess.DEVNULL, text=True,
                              stderr=subprocess.PIPE, env=without_die())
    while not address.exists():
        assert server.poll() is None, server.stderr.read()
        time.sleep(0.05)
    return server, address.read_text().strip()


def test_groups_resumed_at_one_step_with_different_recipes_are_checked_before_averaging_anything(tmp_path):
    # Two groups started by hand from checkpoints of one step copy nothing from each other, where the recipe used to
    # be checked (it was only when a group copied a live one's state); group 1 clips its gradients, group 0 does not.
    trained_here(*RECIPE, "trainer.max_steps=2", f"run_dir={tmp_path / 'first'}")
    server, lighthouse = _lighthouse(tmp_path)
    try:
        groups = [subprocess.Popen([sys.executable, "-m", "launcher.ft", *RECIPE, *GROUPS, "trainer.max_steps=4",
                                    f"checkpoint.resume={tmp_path / 'first' / 'checkpoints' / 'step_2'}",
                                    f"run_dir={tmp_path / 'ft'}", f"fault_tolerance.group={g}",
                                    f"fault_tolerance.lighthouse={lighthouse}", *clip],
                                   cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=without_die())
                  for g, clip in ((0, []), (1, ["trainer.clip_grad_norm=0.01"]))]
        (code0, out0, err0), (code1, out1, err1) = [(group.wait(timeout=600), *group.communicate()) for group in groups]
    finally:
        server.terminate()
        server.wait()
    assert code1 == 2 and not steps(unprefixed(out1, 1)), out1[-3000:] + err1[-3000:]  # it averaged nothing
    assert err1.splitlines() == [
        "[group 1] launcher: fault_tolerance: this group's recipe differs from the live groups' in "
        "trainer.clip_grad_norm (0.01 here, None in the live groups); a group joins only a run of the same recipe, and "
        "this one was not averaged in"], err1
    assert code0 == 0 and steps(unprefixed(out0, 0)) == [3, 4], out0[-3000:] + err0[-3000:]  # the live group trains on


def test_a_group_whose_recipe_differs_from_groups_that_trained_is_refused_and_they_train_on():
    # Decided from the rows every member of a new quorum hands the others: those that trained already are the run's,
    # else the lowest group's
    run, other = {"seed": 0, "trainer.clip_grad_norm": None}, {"seed": 0, "trainer.clip_grad_norm": 0.01}
    rows = [(False, 0, same_recipe.normal(other)), (True, 1, same_recipe.normal(run))]
    assert same_recipe.refusal(rows, run) is None
    assert same_recipe.refusal(rows, other) == (
        "fault_tolerance: this group's recipe differs from the live groups' in trainer.clip_grad_norm (0.01 here, None "
        "in the live groups); a group joins only a run of the same recipe, and this one was not averaged in")
    fresh = [(False, 0, same_recipe.normal(run)), (False, 1, same_recipe.normal(other))]
    assert same_recipe.refusal(fresh, run) is None and same_recipe.refusal(fresh, other) is not None
