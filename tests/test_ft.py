"""Fault tolerance with real processes: python -m launcher.ft, its lighthouse on loopback, two replica groups of
one process each, gloo on the CPU. A group is killed with SIGKILL inside the forward of a step chosen by a seeded
draw (tests/components_ft.py), so that runs can be compared step for step."""

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, assert_same_weights, state_dict, trained_here
from tests.ft_runs import (redone, GROUPS, JOIN, KILLED_AT, PACED, PG, RECIPE, STEPS, Run, assert_logged_as, ddp, hold, join, steps,
                           unprefixed, without_die)

pytestmark = pytest.mark.slow
pytest.importorskip("torchft", reason="torchft's wheels are Linux x86-64 only (the dev extra installs it there)")


def test_two_groups_end_with_the_weights_of_ddp_on_two_processes_and_their_checkpoint_resumes_anywhere(tmp_path):
    run = Run(*RECIPE, *GROUPS, "trainer.max_steps=40", "checkpoint.every=20", f"run_dir={tmp_path / 'ft'}")
    assert run.finish() == 0, run.text()[-3000:]
    for group in (0, 1):
        assert steps(run.of(group)) == list(range(1, 41))  # every step committed by both, none dropped
    ddp(*RECIPE, "trainer.max_steps=40", f"run_dir={tmp_path / 'ddp'}")
    # Bitwise, not within a tolerance: each group computes what a ddp rank computes on the same 16 items (the
    # same kernels, one thread each), and ddp's average of two gradients, g0/2 + g1/2, is torchft's (g0 + g1)/2
    # to the last bit: halving is exact in binary floating point, and a sum of two terms has one order.
    assert_same_weights(tmp_path / "ddp" / "model.pt", tmp_path / "ft" / "group_0" / "model.pt")
    assert_same_weights(tmp_path / "ft" / "group_0" / "model.pt", tmp_path / "ft" / "group_1" / "model.pt")
    # The lowest live group wrote the periodic checkpoint; group 1 only its final one
    saved = {g: sorted(p.name for p in (tmp_path / "ft" / f"group_{g}" / "checkpoints").glob("step_*")) for g in (0, 1)}
    assert saved == {0: ["step_20", "step_40"], 1: ["step_40"]}
    # Group 0's checkpoint of step 20 resumes under ddp on two processes (bitwise again) and in one process
    middle = tmp_path / "ft" / "group_0" / "checkpoints" / "step_20"
    ddp(*RECIPE, "trainer.max_steps=40", f"run_dir={tmp_path / 'ddp-resumed'}", f"checkpoint.resume={middle}")
    assert_same_weights(tmp_path / "ddp-resumed" / "model.pt", tmp_path / "ft" / "group_0" / "model.pt")
    said = trained_here(*RECIPE, "trainer.max_steps=40", f"run_dir={tmp_path / 'one'}", f"checkpoint.resume={middle}")
    assert "resumed from" in said and "(step 20" in said
    one, ft = state_dict(tmp_path / "one" / "model.pt"), state_dict(tmp_path / "ft" / "group_0" / "model.pt")
    for key in ft:  # one process averages 32 items where two average 16 each: rounding alone (test_strategies' bound)
        torch.testing.assert_close(one[key], ft[key], rtol=1e-5, atol=1e-6)


def test_a_step_waits_for_no_quorum_unless_the_groups_changed_and_ends_bitwise_as_ddp(tmp_path):
    # Each quorum a group starts, as torchft is asked for it (tests/components_ft.py's FT_TEST_ROUNDS): a synchronous
    # one (the step waits for it before it reads its batch) in the first step alone, where the groups meet; each
    # later step's comes during the step (optimistic), once, and the step stands on it. A group of one process asks
    # its manager server for no commit vote (the vote is its own: launcher/ft/rounds.py, Seen).
    plain = [*RECIPE, "trainer.max_steps=20", "step._target_=tests.components_ft.paced_step", "step._partial_=true",
             "step.seconds=0"]
    run = Run(*plain, *GROUPS, f"run_dir={tmp_path / 'ft'}", env={"FT_TEST_ROUNDS": str(tmp_path / "rounds")})
    assert run.finish() == 0, run.text()[-3000:]
    for group in (0, 1):
        started = rounds(tmp_path / f"rounds.{group}")
        assert not [step for step, kind in started if kind == "vote"], started
        assert [step for step, kind in started if kind == "synchronous"] == [0], started
        assert [(step, kind) for step, kind in started if step > 0] == [(step, "optimistic") for step in range(1, 20)]
        assert steps(run.of(group)) == list(range(1, 21))
    ddp(*plain, f"run_dir={tmp_path / 'ddp'}")
    assert_same_weights(tmp_path / "ddp" / "model.pt", tmp_path / "ft" / "group_0" / "model.pt")
    assert_same_weights(tmp_path / "ft" / "group_0" / "model.pt", tmp_path / "ft" / "group_1" / "model.pt")


def rounds(path) -> list:
    """(torchft's step count, the quorum's kind) of each quorum a group started, and (step, 'vote') of each commit
    vote its processes asked their manager server for."""
    return [(int(step), kind) for step, kind in (line.split() for line in path.read_text().splitlines())]


def test_groups_of_two_ddp_processes_end_with_the_weights_of_ddp_on_four(tmp_path):
    probed = ["step._target_=tests.components_ft.paced_step", "step._partial_=true", "step.seconds=0"]  # its probes
    run = Run(*RECIPE, *probed, *GROUPS, "trainer.max_steps=20", "logging.jsonl=true", "strategy=ddp",
              "nproc_per_node=2", f"run_dir={tmp_path / 'ft'}", env={"FT_TEST_ROUNDS": str(tmp_path / "rounds")})
    assert run.finish() == 0, run.text()[-3000:]
    assert "(ddp)" in "".join(run.of(0)) and steps(run.of(1)) == list(range(1, 21))
    for group in (0, 1):  # a group of two processes commits only where both vote to, through its manager server
        votes = [step for step, kind in rounds(tmp_path / f"rounds.{group}") if kind == "vote"]
        assert sorted(votes) == sorted([*range(20), *range(20)]), votes
    ddp(*RECIPE, *probed, "trainer.max_steps=20", "logging.jsonl=true", f"run_dir={tmp_path / 'ddp'}", processes=4)
    assert_logged_as(tmp_path / "ddp", tmp_path / "ft", rel=1e-5)  # (a mean over the group's two processes)
    assert_same_weights(tmp_path / "ft" / "group_0" / "model.pt", tmp_path / "ft" / "group_1" / "model.pt")
    four, ft = state_dict(tmp_path / "ddp" / "model.pt"), state_dict(tmp_path / "ft" / "group_0" / "model.pt")
    for key in ft:  # four gradients summed in another order ((a + b) + (c + d) against gloo's ring): rounding alone,
        torch.testing.assert_close(ft[key], four[key], rtol=1e-5, atol=1e-6)  # test_strategies' bound


def test_a_signal_stops_every_group_saved_and_the_same_command_resumes_them(tmp_path):
    paced = [*RECIPE, *GROUPS, "step._target_=tests.components_ft.paced_step", "step._partial_=true",
             "step.seconds=0.04", "trainer.max_steps=60", f"run_dir={tmp_path / 'ft'}"]
    run = Run(*paced)
    run.wait_for(r"\[group 1\] step 20/")
    run.process.send_signal(signal.SIGTERM)  # passed on to both groups: each saves at its next step boundary
    assert run.finish() == 143, run.text()[-3000:]
    stopped = [int(re.search(r"stopped by SIGTERM after step (\d+): saved", "".join(run.of(g))).group(1)) for g in (0, 1)]
    again = Run(*paced)
    assert again.finish() == 0, again.text()[-3000:]
    for g in (0, 1):  # each group from its own folder's checkpoint; one behind the other would copy its state live
        assert f"resumed from {tmp_path / 'ft' / f'group_{g}' / 'checkpoints' / f'step_{stopped[g]}'}" in "".join(again.of(g))
    assert_same_weights(tmp_path / "ft" / "group_0" / "model.pt", tmp_path / "ft" / "group_1" / "model.pt")
    if stopped[0] == stopped[1]:  # (a signal landing between the two groups' checks of one step stops one a step
        # later, which it trains alone: then the run is another function of which groups were live)
        ddp(*RECIPE, "trainer.max_steps=60", f"run_dir={tmp_path / 'ddp'}")  # the paced step computes the same loss
        assert_same_weights(tmp_path / "ddp" / "model.pt", tmp_path / "ft" / "group_0" / "model.pt")


def test_a_closed_terminal_stops_every_group_saved_and_their_lines_stay_in_their_run_folders(tmp_path):
    # The terminal goes first (its pipe closed: what launcher.ft writes then fails), then its SIGHUP comes, which is
    # passed on to each group as SIGTERM: each saves at its next step boundary, and says so in its own folder.
    ft = subprocess.Popen([sys.executable, "-m", "launcher.ft", *RECIPE, *GROUPS, *PACED, "trainer.max_steps=5000",
                           f"run_dir={tmp_path}"],  # (it stops long before)
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=without_die())
    seen = b""
    while b"[group 1] step 5/" not in seen and b"[group 0] step 5/" not in seen:  # the groups train
        got = os.read(ft.stdout.fileno(), 65536)
        assert got, seen.decode()[-3000:]
        seen += got
    ft.stdout.close()
    ft.send_signal(signal.SIGHUP)
    assert ft.wait(timeout=300) == 128 + signal.SIGHUP
    for g in (0, 1):
        said = (tmp_path / f"group_{g}" / "stdout.log").read_text()
        stopped = re.search(r"stopped by SIGTERM after step (\d+): saved (\S+)\n", said)
        assert stopped and (tmp_path / f"group_{g}" / "checkpoints" / f"step_{stopped.group(1)}" / "manifest.json").exists()
        assert steps(said.splitlines())[-1] == int(stopped.group(1)) >= 5


# With accumulation the gradients are rescaled to the step's total of items after the last backward: after the
# average across groups, as ddp rescales after its all-reduce (before it, the product rounds another way)
ACCUMULATED = ["trainer.grad_accum_steps=2", "data.batch_size=16", "trainer.clip_grad_norm=0.5",
               "lr_schedule={_target_: torch.optim.lr_scheduler.StepLR, step_size: 5, gamma: 0.5}"]


@pytest.mark.parametrize("accumulated", [[], ACCUMULATED], ids=["one-micro-batch", "accumulated-clipped-scheduled"])
def test_a_step_that_counts_its_items_weighs_every_item_of_every_live_group_alike(tmp_path, accumulated):
    # Each group's item count differs from step to step; the step's gradient is that of the summed losses over
    # the items of every live group, as under ddp (the counts are summed across groups too): bitwise, as above.
    counted = [*RECIPE, "trainer.max_steps=20", "step._target_=tests.components_ft.counted_step", "step._partial_=true",
               "loss.reduction=none", *accumulated]
    run = Run(*counted, *GROUPS, f"run_dir={tmp_path / 'ft'}")
    assert run.finish() == 0, run.text()[-3000:]
    ddp(*counted, f"run_dir={tmp_path / 'ddp'}")
    assert_same_weights(tmp_path / "ddp" / "model.pt", tmp_path / "ft" / "group_0" / "model.pt")


def test_a_killed_group_leaves_the_other_training_and_rejoins_live_bitwise_equal(tmp_path):
    run = Run(*RECIPE, *GROUPS, *PACED, "checkpoint.every=50", f"run_dir={tmp_path}",
              env={"FT_TEST_DIE": f"1:{KILLED_AT}", **hold(), "FT_TEST_ROUNDS": str(tmp_path / "rounds")})
    lighthouse = run.wait_for(r"lighthouse at (\S+)").group(1)
    pid = int(run.wait_for(r"group 0: started \(process (\d+)\)").group(1))
    run.wait_for(r"group 1: killed by SIGKILL; 1 group trains on")
    # Started again once group 0 has gone on alone (a group that joins sooner is in the next quorum at once)
    run.wait_for(rf"\[group 0\] fault tolerance: step {KILLED_AT}: 1 of 2 groups live")
    run.wait_for(rf"\[group 0\] step {KILLED_AT + 5}/")
    again = join(lighthouse, tmp_path, "checkpoint.resume=never")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert run.finish() == 0, run.text()[-3000:]
    # The live group: one process from start to end, its steps in order, none twice, none back
    lived = run.of(0)
    assert [line for line in lived if "fault tolerance: group 0 of 2" in line] == [
        next(line for line in lived if f"(process {pid})" in line)]
    done = steps(lived)
    assert done == list(range(1, STEPS + 1)), [line for line in lived if "fault tolerance" in line]
    assert redone(KILLED_AT, "".join(lived))  # the step group 1 died in
    # The group started again: it read no checkpoint, took the live state and trained the rest with group 0
    joined = again.stdout
    recovered = int(re.search(r"recovered live from a live group at step (\d+) \(.*no checkpoint read\)", joined).group(1))
    assert "resumed from" not in joined and KILLED_AT < recovered < STEPS
    assert steps(unprefixed(joined, 1)) == list(range(recovered + 1, STEPS + 1))
    assert f"fault tolerance: step {recovered + 1}: 2 of 2 groups live" in "".join(lived)
    # The live group waited for a quorum before reading a batch only where the groups changed: the first step, the
    # step after group 1's death (its quorum a new one), and the step group 1 joined in (started optimistically,
    # then dropped unaveraged and trained again, with group 1, after a synchronous quorum)
    started = rounds(tmp_path / "rounds.0")
    assert [step for step, kind in started if kind == "synchronous"] == [0, KILLED_AT - 1, recovered], started
    assert {step for step, kind in started if kind == "optimistic"} == set(range(STEPS))
    assert_same_weights(tmp_path / "group_0" / "model.pt", tmp_path / "group_1" / "model.pt")
    assert sorted(p.name for p in (tmp_path / "group_1" / "checkpoints").glob("step_*")) == [f"step_{STEPS}"]


def test_a_group_with_another_recipe_is_refused_in_one_line_and_never_averaged_in(tmp_path):
    # The same run twice, side by side: group 1 dies at the same step in both; in one, a group with another seed
    # and model then tries to join. Group 0 must end with the same weights in both.
    # (both hold for group 1 until the wrong one has been refused: the live group is still training when it comes)
    die = {"FT_TEST_DIE": f"1:{KILLED_AT}", **hold(release=tmp_path / "refused")}
    alone = Run(*RECIPE, *GROUPS, *PACED, f"run_dir={tmp_path / 'alone'}", env=die)
    run = Run(*RECIPE, *GROUPS, *PACED, f"run_dir={tmp_path / 'run'}", env=die)
    lighthouse = run.wait_for(r"lighthouse at (\S+)").group(1)
    run.wait_for(r"group 1: killed by SIGKILL")
    wrong = join(lighthouse, tmp_path / "run", "seed=1", "model.hidden=64")
    (tmp_path / "refused").touch()
    assert wrong.returncode == 2
    assert wrong.stderr.splitlines() == [
        "[group 1] launcher: fault_tolerance: this group's recipe differs from the live groups' in model.hidden (64 "
        "here, 128 in the live groups); seed (1 here, 0 in the live groups); a group joins only a run of the same "
        "recipe, and this one was not averaged in"], wrong.stderr
    assert not steps(unprefixed(wrong.stdout, 1))  # it trained no step
    assert run.finish() == 0 and alone.finish() == 0, run.text()[-3000:] + alone.text()[-3000:]
    assert steps(run.of(0)) == list(range(1, STEPS + 1))
    assert_same_weights(tmp_path / "alone" / "group_0" / "model.pt", tmp_path / "run" / "group_0" / "model.pt")


def test_a_frozen_group_is_dropped_and_after_sigcont_rejoins_live_in_the_same_process(tmp_path, own_processes):
    run = Run(*RECIPE, *GROUPS, *PACED, f"run_dir={tmp_path}", env=hold())
    pid = int(run.wait_for(r"group 1: started \(process (\d+)\)").group(1))
    run.wait_for(rf"\[group 1\] step {KILLED_AT}/")
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped_at = int(run.wait_for(r"\[group 0\] fault tolerance: step (\d+): 1 of 2 groups live").group(1))
        run.wait_for(rf"\[group 0\] step {stopped_at + 5}/")  # group 0 trains on alone
    finally:
        os.kill(pid, signal.SIGCONT)
    assert run.finish() == 0, run.text()[-3000:]
    assert steps(run.of(0)) == list(range(1, STEPS + 1))
    back = run.of(1)
    recovered = int(re.search(r"recovered live from a live group at step (\d+)", "".join(back)).group(1))
    assert stopped_at + 5 <= recovered < STEPS
    # the same process all along: its steps before the freeze, then those after the copy, each once
    assert steps(back) == [*range(1, stopped_at), *range(recovered + 1, STEPS + 1)]
    assert [line for line in back if "fault tolerance: group 1 of 2" in line] == [
        next(line for line in back if f"(process {pid})" in line)]
    assert_same_weights(tmp_path / "group_0" / "model.pt", tmp_path / "group_1" / "model.pt")


def test_fewer_live_groups_than_min_groups_make_the_step_wait_then_stop_in_one_line(tmp_path):
    run = Run(*RECIPE, *GROUPS, *PACED, "fault_tolerance.min_groups=2", f"fault_tolerance.timeouts.quorum={3 * PG}",
              f"run_dir={tmp_path}", env={"FT_TEST_DIE": f"1:{KILLED_AT}"})
    assert run.finish() == 6, run.text()[-3000:]  # group 0's code: group 1 was killed, group 0 stopped
    lived, address = run.of(0), run.wait_for(r"lighthouse at (\S+)").group(1)
    assert steps(lived) == list(range(1, KILLED_AT))  # the step group 1 died in was never trained alone
    # its state at the step boundary is whole: saved, and the same command goes on from it
    saved = tmp_path / "group_0" / "checkpoints" / f"step_{KILLED_AT - 1}"
    assert (saved / "manifest.json").exists() and f"the same command resumes from step {KILLED_AT - 1}" in "".join(lived)
    assert [line for line in lived if "launcher:" in line] == [
        f"launcher: fault_tolerance: no quorum for step {KILLED_AT} within timeouts.quorum={3 * PG} s (timed out): fewer "
        f"than min_groups=2 groups are live, or the lighthouse at {address} is gone; this group stops (each group "
        f"resumes its newest checkpoint when started again)\n"]


def test_the_lighthouse_lost_stops_every_group_in_one_line(tmp_path):
    lighthouse = subprocess.Popen(
        [sys.executable, "-c", "import time; from launcher.ft import lighthouse\n"
                               "from launcher.recipe.fault_tolerance import FaultToleranceConfig as C, "
                               "FaultToleranceTimeouts as T\n"
                               f"server = lighthouse.start(C(timeouts=T(pg={PG}, quorum={3 * PG}, join={JOIN})))\n"
                               "print(server.address(), flush=True); time.sleep(600)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        address = lighthouse.stdout.readline().strip()
        run = Run(*RECIPE, *GROUPS, *PACED, "trainer.max_steps=5000", f"fault_tolerance.timeouts.quorum={3 * PG}",
                  f"fault_tolerance.lighthouse={address}", f"run_dir={tmp_path}")  # (it stops long before)
        run.wait_for(r"\[group 0\] step 20/")
        run.wait_for(r"\[group 1\] step 20/")
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert run.finish() == 6, run.text()[-3000:]
    for group in (0, 1):
        last = steps(run.of(group))[-1]  # each group saved its last step, whole, into its own folder
        assert (tmp_path / f"group_{group}" / "checkpoints" / f"step_{last}" / "manifest.json").exists(), group
        said = [line for line in run.of(group) if "launcher:" in line]
        assert len(said) == 1 and re.fullmatch(
            rf"launcher: fault_tolerance: no quorum for step \d+ within timeouts.quorum={3 * PG} s \(.*\): fewer than "
            rf"min_groups=1 groups are live, or the lighthouse at {re.escape(address)} is gone; this group stops .*\n",
            said[0]), said
