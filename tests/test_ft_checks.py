"""Fault tolerance's checks on what groups share (tests/ft_runs.py's runs: python -m launcher.ft, a lighthouse on
loopback, groups of one process): a checkpoint.dir outside the run folder, and the recipe every group is checked
against before it averages anything, however it starts. Few steps each: what is checked is decided before the first."""

import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, assert_same_weights
from tests.ft_runs import GROUPS, RECIPE, Run, steps, without_die

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
