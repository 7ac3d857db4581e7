"""Fault tolerance with three replica groups: a group killed with SIGKILL at each seeded point of a step (forward,
backward, the all-reduce, the optimizer step, a checkpoint save), every group lost and started again, and a
checkpoint resumed by another number of groups. Real processes: python -m launcher.ft, its lighthouse on loopback,
gloo on the CPU (tests/ft_runs.py); the kills are tests/components_ft.py's."""

import re

import pytest

from tests.conftest import assert_same_weights
from tests.ft_runs import KILLED_AT, PACED, RECIPE, STEPS, TIMEOUTS, Run, ddp, hold, join, steps, unprefixed
from tests.float64 import overrides as float64
from tests.rounding import assert_within_rounding

pytestmark = pytest.mark.slow
pytest.importorskip("torchft", reason="torchft's wheels are Linux x86-64 only (the dev extra installs it there)")

THREE = ["fault_tolerance.groups=3", *TIMEOUTS, "data.batch_size=48"]  # 16 items a group
EVERY = 10  # checkpoint.every of the run whose groups are all lost
SAVES = 5  # checkpoint.every of the kill points: the save killed is that of the first checkpoint step after
SAVED_AT = (KILLED_AT // SAVES + 1) * SAVES  # KILLED_AT, and one more comes while its group is away

# (the point, the group killed there, the forward it dies in, whether the live groups drop that step): a step
# whose all-reduce a group never finished is dropped; one the groups committed is kept by the live ones.
POINTS = [("forward", 2, KILLED_AT, True), ("backward", 1, KILLED_AT, True), ("allreduce", 2, KILLED_AT, True),
          ("optimizer", 1, KILLED_AT, False), ("save", 0, SAVED_AT, False)]  # group 0 writes the periodic saves


@pytest.mark.parametrize("point, killed, at, dropped", POINTS, ids=[p[0] for p in POINTS])
def test_a_group_killed_at_each_point_of_a_step_leaves_the_others_training_and_rejoins_live(tmp_path, point, killed,
                                                                                             at, dropped):
    run = Run(*RECIPE, *THREE, *PACED, f"checkpoint.every={SAVES}", f"run_dir={tmp_path}",
              env={"FT_TEST_DIE": f"{killed}:{at}:{point}", **hold()})
    lighthouse = run.wait_for(r"lighthouse at (\S+)").group(1)
    live = [g for g in range(3) if g != killed]
    pids = {g: int(run.wait_for(rf"group {g}: started \(process (\d+)\)").group(1)) for g in live}
    run.wait_for(rf"group {killed}: killed by SIGKILL; 2 groups train on")
    alone = int(run.wait_for(rf"\[group {live[0]}\] fault tolerance: step (\d+): 2 of 3 groups live").group(1))
    assert alone == (at if dropped else at + 1)  # the step it died in trained again, or the next one without it
    run.wait_for(rf"\[group {live[0]}\] step {alone + 5}/")  # started again once the others have gone on alone
    if point == "save":  # its checkpoint left incomplete (no manifest): never taken for one
        partial = tmp_path / "group_0" / "checkpoints" / f".step_{at}.partial"
        assert sorted(p.name for p in partial.iterdir()) == ["model.pt"]
        assert not (partial.parent / f"step_{at}").exists()
    again = join(lighthouse, tmp_path, "checkpoint.resume=never", f"checkpoint.every={SAVES}", group=killed,
                 groups=tuple(THREE))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert run.finish() == 0, run.text()[-3000:]
    for g in live:  # one process from start to end, its steps in order, none twice, none back
        lived = run.of(g)
        assert [line for line in lived if "fault tolerance: group" in line] == [
            next(line for line in lived if f"(process {pids[g]})" in line)]
        assert steps(lived) == list(range(1, STEPS + 1)), [line for line in lived if "fault tolerance" in line]
        assert (f"fault tolerance: step {at} dropped" in "".join(lived)) == dropped
        assert "dropped" not in "".join(lived).replace(f"step {at} dropped", "")
    # The group started again read no checkpoint, took the live state and trained the rest with the others
    recovered = int(re.search(r"recovered live from a live group at step (\d+) \(.*no checkpoint read\)",
                              again.stdout).group(1))
    assert "resumed from" not in again.stdout and alone + 5 <= recovered < STEPS
    assert steps(unprefixed(again.stdout, killed)) == list(range(recovered + 1, STEPS + 1))
    for g in live:
        assert f"fault tolerance: step {recovered + 1}: 3 of 3 groups live" in "".join(run.of(g))
        assert_same_weights(tmp_path / f"group_{killed}" / "model.pt", tmp_path / f"group_{g}" / "model.pt")
    if point == "save":  # while it was away, the lowest live group wrote the periodic saves (the last `keep` kept)
        written = sorted(int(p.name[5:]) for p in (tmp_path / "group_1" / "checkpoints").glob("step_*"))
        assert written[-1] == STEPS and len(written) > 1 and all(at < k <= recovered for k in written[:-1]), written

def test_every_group_lost_resumes_from_the_newest_checkpoint_of_any_group(tmp_path):
    # Group 0 writes the periodic saves until it dies at step 25; group 1, the lowest live one from then on,
    # writes those of steps 30 and 40 into its own folder, then dies too, at step 45 (its 46th forward: step 25
    # was trained twice). Started again, each group resumes its own folder's newest checkpoint, and group 0
    # (at step 20) copies group 1's (at step 40, the newest) live.
    recipe = [*RECIPE, *PACED[:3], "trainer.max_steps=60", f"checkpoint.every={EVERY}"]
    paced = [*recipe, "fault_tolerance.groups=2", *TIMEOUTS, f"run_dir={tmp_path / 'ft'}"]
    lost = Run(*paced, env={"FT_TEST_DIE": "0:25,1:46"})
    assert lost.finish() == 128 + 9, lost.text()[-3000:]  # the lowest group's end, as a shell says SIGKILL's
    assert "group 0: killed by SIGKILL; 1 group trains on" in lost.text()
    assert "group 1: killed by SIGKILL" in lost.text()
    saved = {g: sorted(p.name for p in (tmp_path / "ft" / f"group_{g}" / "checkpoints").glob("step_*")) for g in (0, 1)}
    assert saved == {0: ["step_10", "step_20"], 1: ["step_30", "step_40"]}
    again = Run(*paced)
    assert again.finish() == 0, again.text()[-3000:]
    newest = tmp_path / "ft" / "group_1" / "checkpoints" / "step_40"
    behind = "".join(again.of(0))
    assert f"resumed from {tmp_path / 'ft' / 'group_0' / 'checkpoints' / 'step_20'}" in behind
    assert "recovered live from a live group at step 40" in behind
    assert f"resumed from {newest}" in "".join(again.of(1))
    for g in (0, 1):  # neither trained a step twice after the restart, nor any before the newest checkpoint
        assert steps(again.of(g)) == list(range(41, 61)), steps(again.of(g))
    assert_same_weights(tmp_path / "ft" / "group_0" / "model.pt", tmp_path / "ft" / "group_1" / "model.pt")
    # Exactly what ddp on two processes trains from that checkpoint (bitwise: tests/test_ft.py says why)
    ddp(*recipe, f"run_dir={tmp_path / 'ddp'}", f"checkpoint.resume={newest}")
    assert_same_weights(tmp_path / "ddp" / "model.pt", tmp_path / "ft" / "group_0" / "model.pt")


def test_a_checkpoint_of_two_groups_resumes_with_three_as_ddp_on_three_does(tmp_path):
    # In float64, where another order of the same sums is rounding alone (tests/rounding.py): three groups
    # average (g0 + g1 + g2) / 3 where ddp sums g0/3 + g1/3 + g2/3.
    recipe = [*RECIPE, *float64("recipes.components.mlp.MLP"), "data.batch_size=48", "trainer.max_steps=30"]
    two = Run(*recipe, "fault_tolerance.groups=2", *TIMEOUTS, "checkpoint.every=15", f"run_dir={tmp_path / 'two'}")
    assert two.finish() == 0, two.text()[-3000:]
    middle = tmp_path / "two" / "group_0" / "checkpoints" / "step_15"
    three = Run(*recipe, *THREE, f"checkpoint.resume={middle}", f"run_dir={tmp_path / 'three'}")
    assert three.finish() == 0, three.text()[-3000:]
    for g in range(3):
        assert f"resumed from {middle}" in "".join(three.of(g)) and steps(three.of(g)) == list(range(16, 31))
    ddp(*recipe, f"checkpoint.resume={middle}", f"run_dir={tmp_path / 'ddp'}", processes=3)
    for g in range(3):
        assert_same_weights(tmp_path / "three" / "group_0" / "model.pt", tmp_path / "three" / f"group_{g}" / "model.pt")
    assert_within_rounding(tmp_path / "ddp" / "model.pt", tmp_path / "three" / "group_0" / "model.pt", steps=15)
