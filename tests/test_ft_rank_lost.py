"""Fault tolerance when one process of a group of several dies: the group leaves the run at once and the live
group trains on (launcher/ft/leaving.py). Two groups of two processes, real torchrun and gloo on the CPU, the
lighthouse on loopback (tests/ft_runs.py); rank 1 of group 1 kills itself once its step's all-reduce across the
groups has started, so its rank 0 is left waiting in torchft's commit for the dead rank's vote (the case that
kept the group's heartbeat going and denied the live group its quorum)."""

import re

import pytest

from tests.ft_runs import KILLED_AT, PACED, PG, RECIPE, Run, steps, redone

pytestmark = pytest.mark.slow
pytest.importorskip("torchft", reason="torchft's wheels are Linux x86-64 only (the dev extra installs it there)")

# quorum < torchrun's 30 s between its SIGTERM and its SIGKILL of a worker, and < join, which bounds torchft's wait
# for the dead rank's vote: without the group leaving at once, the live group's quorum gives up first (exit 6)
TIMEOUTS = ["fault_tolerance.groups=2", f"fault_tolerance.timeouts.pg={min(PG, 5)}", "fault_tolerance.timeouts.quorum=20",
            "fault_tolerance.timeouts.join=25"]
STEPS = KILLED_AT + 4
COUNTED = [*PACED[:2], "step.seconds=0"]  # the step that counts its forwards and kills its process at the one asked


@pytest.mark.parametrize("layout", [["strategy=ddp"], ["strategy=fsdp"]], ids=["ddp", "fsdp"])
def test_one_process_of_a_group_killed_makes_its_group_leave_at_once_and_the_other_trains_on(tmp_path, layout):
    run = Run(*RECIPE, *TIMEOUTS, *COUNTED, *layout, "nproc_per_node=2", f"trainer.max_steps={STEPS}", f"run_dir={tmp_path}",
              env={"FT_TEST_DIE": f"1:{KILLED_AT}:allreduce:1"})
    assert run.finish() == 0, run.text()[-3000:]
    lived, left = run.of(0), "".join(run.of(1))
    assert steps(lived) == list(range(1, STEPS + 1)), steps(lived)  # in order, none twice, none back
    # the step it died in: dropped and trained again alone, or committed already (its all-reduce had ended)
    alone = int(re.search(r"fault tolerance: step (\d+): 1 of 2 groups live\n", "".join(lived)).group(1))
    assert alone in (KILLED_AT, KILLED_AT + 1)
    assert redone(KILLED_AT, "".join(lived)) == (alone == KILLED_AT)
    assert "no quorum" not in run.text()
    # its rank 0 said why it left, once, and trained nothing after the step it was in
    said = re.findall(r"launcher: fault tolerance: rank 0 of group 1: rank 1 \(process \d+\) of this group is gone; "
                      r"the group leaves the run now, unsaved", left)
    assert len(said) == 1, left[-3000:]
    assert steps(run.of(1)) == list(range(1, KILLED_AT)), steps(run.of(1))
    assert "launcher.ft: group 1: exited with 1; 1 group trains on" in run.text()
