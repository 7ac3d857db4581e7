"""Fault tolerance's checks on what groups share (tests/ft_runs.py's runs: python -m launcher.ft, a lighthouse on
loopback, groups of one process): a checkpoint.dir outside the run folder, and the recipe every group is checked
against before it averages anything, however it starts. Few steps each: what is checked is decided before the first."""

import json
import subprocess
import sys
import time

import pytest
import torch
import yaml

from tests.conftest import REPO, assert_same_weights, state_dict, trained_here
from launcher.ft import same_recipe
from launcher.observe.throughput import Throughput
from launcher.run.metrics import TrainMeter
from tests.ft_runs import GROUPS, RECIPE, Run, ddp, steps, unprefixed, without_die

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


def test_samples_per_s_counts_what_the_live_groups_trained_and_mfu_what_one_group_computed():
    # Two steps of a run of two replica groups, the second trained by one group alone: 1.5 global batches of 32,
    # in the 10 s the interval took (its clock set back); each group computes 16 items a step on its own devices.
    meter = TrainMeter({}, torch.device("cpu"), Throughput(32, flops_per_sample=1.0, peak_flops_all_devices=2.0,
                                                           groups=2))
    meter.start(0)
    for trained in (1.0, 0.5):
        meter.add(torch.tensor(1.0), None, None)
        meter.step_done(None, trained)
    meter.clock = time.perf_counter() - 10
    read = meter.read(lambda t: t, lr=0.1)
    assert read["train/samples_per_s"] == pytest.approx(1.5 * 32 / 10, rel=1e-3)
    assert read["train/mfu"] == pytest.approx(2 * 16 / 10 / 2.0, rel=1e-3)


def test_every_group_evaluates_the_whole_val_set_so_their_val_loss_is_the_runs(tmp_path):
    val = ["data.val._target_=recipes.components.synthetic.Blobs", "data.val.n=96", "data.val.spread=3.0",
           "data.val.split=1", "trainer.max_steps=2", "trainer.eval_every=2", "logging.jsonl=true"]
    run = Run(*RECIPE, *GROUPS, *val, f"run_dir={tmp_path / 'ft'}")
    assert run.finish() == 0, run.text()[-3000:]
    logged = [[json.loads(line) for line in (tmp_path / "ft" / f"group_{g}" / "metrics.jsonl").read_text().splitlines()
               if "val/loss" in line] for g in (0, 1)]
    assert len(logged[0]) == len(logged[1]) == 1
    assert logged[0][0]["val/loss"] == logged[1][0]["val/loss"]  # the same weights on the same 96 items, in the same batches
    # and it is the loss of the whole val set, all 96 items, under the weights they ended with
    from recipes.components.mlp import MLP
    from recipes.components.synthetic import Blobs

    model, items = MLP(in_dim=32, hidden=128, classes=10), Blobs(n=96, spread=3.0, split=1)
    model.load_state_dict(state_dict(tmp_path / "ft" / "group_0" / "model.pt"))
    with torch.no_grad():
        whole = torch.nn.functional.cross_entropy(model(items.x), items.y).item()
    assert logged[0][0]["val/loss"] == pytest.approx(whole, rel=1e-5)


def test_a_group_that_joins_a_stream_takes_the_live_groups_place_in_it(tmp_path):
    # A stream (BlobStream: no state of its own, read again and skipped to a place). Group 1 dies in step 4; group 0
    # may not train alone (min_groups=2): it drops step 4 and waits, its stream rewound to the step's start. Group 1
    # started again copies group 0's state and its place in the stream. Every step was then trained by both groups
    # on the items ddp x2 reads: bitwise ddp's weights, unless a group read from another place than the other.
    stream = [*RECIPE, "data.train._target_=recipes.components.synthetic.BlobStream", "trainer.max_steps=8",
              "step._target_=tests.components_ft.paced_step", "step._partial_=true", "step.seconds=0"]
    waiting = ["fault_tolerance.groups=2", "fault_tolerance.min_groups=2", "fault_tolerance.timeouts.pg=2",
               "fault_tolerance.timeouts.quorum=300", "fault_tolerance.timeouts.join=400"]
    run = Run(*stream, *waiting, f"run_dir={tmp_path / 'ft'}", env={"FT_TEST_DIE": "1:4"})
    lighthouse = run.wait_for(r"lighthouse at (\S+)").group(1)
    run.wait_for(r"group 1: killed by SIGKILL")
    again = subprocess.run([sys.executable, "-m", "launcher.ft", *stream, *waiting, f"run_dir={tmp_path / 'ft'}",
                            "fault_tolerance.group=1", f"fault_tolerance.lighthouse={lighthouse}"],
                           cwd=REPO, capture_output=True, text=True, timeout=600, env=without_die())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert run.finish() == 0, run.text()[-3000:]
    assert "recovered live from a live group at step 3" in again.stdout, again.stdout[-3000:]
    assert steps(unprefixed(again.stdout, 1)) == [4, 5, 6, 7, 8] and steps(run.of(0)) == list(range(1, 9))
    ddp(*stream, f"run_dir={tmp_path / 'ddp'}")
    for g in (0, 1):
        assert_same_weights(tmp_path / "ddp" / "model.pt", tmp_path / "ft" / f"group_{g}" / "model.pt")
