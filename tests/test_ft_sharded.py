"""Fault tolerance with groups that shard the model inside themselves: fsdp, tp and hsdp on two processes a group,
two groups, python -m launcher.ft on loopback, gloo on the CPU (tests/ft_runs.py). Across the groups each rank
averages its own gradient shards with the same rank of the other live groups, and a group killed mid-step and
started again copies a live group's shards and optimizer state rank by rank."""

import re

import pytest
import torch

from tests.conftest import assert_same_weights
from tests.ft_runs import (redone, GROUPS, KILLED_AT, PACED, RECIPE, STEPS, Run, assert_logged_as, hold, join, steps, torchrun,
                           unprefixed)
from tests.float64 import overrides as float64
from tests.rounding import assert_within_rounding

pytestmark = pytest.mark.slow
pytest.importorskip("torchft", reason="torchft's wheels are Linux x86-64 only (the dev extra installs it there)")

FSDP = ["strategy=fsdp", "nproc_per_node=2"]
TP = ["parallel.tp=2", "parallel.tp_plan={'0': colwise, '2': rowwise}"]
SHORT = 12  # steps of the runs that compare layouts

# (inside each group of two processes; the layout on four processes that computes the same sums in the same order
# on shards of the same shapes, or None; one whose sums differ in order, or None). Bitwise: a group's two data
# ranks sum theirs first (its fsdp's reduce-scatter), then the two groups' (torchft's all-reduce), as HSDP's
# dp_shard then dp_replicate do; halving is exact, and a sum of two terms has one order. Shards of other shapes
# run the optimizer's vector kernels over other lengths (their tails round apart): within rounding, in float64.
LAYOUTS = {"fsdp": ([], ["parallel.dp_replicate=2"], []),  # groups: HSDP's dp_replicate made fault tolerant
           "tp": (TP, [*TP, "parallel.dp_replicate=2"], None),  # a group: tp 2; four processes: dp_replicate 2 x tp 2
           "hsdp": (["parallel.dp_replicate=2"], None, [])}  # a group: dp_replicate 2; four: dp_shard 4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_groups_that_shard_end_with_the_weights_of_the_same_layout_on_four_processes(tmp_path, layout):
    inside, same, other = LAYOUTS[layout]
    recipe = [*RECIPE, *float64("recipes.components.mlp.MLP"), f"trainer.max_steps={SHORT}", "logging.jsonl=true",
              "strategy=fsdp"]
    run = Run(*recipe, *GROUPS, "nproc_per_node=2", *inside, f"run_dir={tmp_path / 'ft'}")
    assert run.finish() == 0, run.text()[-3000:]
    for group in (0, 1):
        assert steps(run.of(group)) == list(range(1, SHORT + 1))  # none dropped
    ft = tmp_path / "ft" / "group_0" / "model.pt"
    assert_same_weights(ft, tmp_path / "ft" / "group_1" / "model.pt")
    if same is not None:
        torchrun(*recipe, *same, f"run_dir={tmp_path / 'same'}", processes=4)
        assert_same_weights(tmp_path / "same" / "model.pt", ft)
    if other is not None:
        torchrun(*recipe, *other, f"run_dir={tmp_path / 'other'}", processes=4)
        assert_within_rounding(tmp_path / "other" / "model.pt", ft, steps=SHORT)
    # each group logs its own share's loss, and the gradients' norm after the average across groups
    assert_logged_as(tmp_path / ("same" if same is not None else "other"), tmp_path / "ft", rel=1e-6)


def _sharded_state(checkpoint, out):
    """A sharded checkpoint's model and optimizer state, every rank's shards put together."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, map_location="cpu", weights_only=False)
    return {"model": state["model"], "optimizer": state["optimizer"]}


def _assert_equal(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_a_killed_group_of_fsdp_processes_rejoins_live_rank_by_rank_bitwise_equal(tmp_path):
    run = Run(*RECIPE, *GROUPS, *PACED, *FSDP, f"run_dir={tmp_path}",
              env={"FT_TEST_DIE": f"1:{KILLED_AT}", **hold()})  # both processes of group 1, in the forward of that step
    lighthouse = run.wait_for(r"lighthouse at (\S+)").group(1)
    run.wait_for(r"group 1: exited with 1; 1 group trains on")  # torchrun's end when its processes were killed
    run.wait_for(rf"\[group 0\] fault tolerance: step {KILLED_AT}: 1 of 2 groups live")
    run.wait_for(rf"\[group 0\] step {KILLED_AT + 5}/")
    again = join(lighthouse, tmp_path, *FSDP, "checkpoint.resume=never")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert run.finish() == 0, run.text()[-3000:]
    lived = run.of(0)
    assert steps(lived) == list(range(1, STEPS + 1)), [x for x in lived if "fault tolerance" in x]  # in order, none back
    assert redone(KILLED_AT, "".join(lived))
    # Group 1 started again read no checkpoint: each of its ranks took the same rank's shards of a live group
    joined = again.stdout
    recovered = int(re.search(r"recovered live from a live group at step (\d+) \(.*no checkpoint read\)",
                              joined).group(1))
    assert "resumed from" not in joined and KILLED_AT < recovered < STEPS
    assert steps(unprefixed(joined, 1)) == list(range(recovered + 1, STEPS + 1))
    assert f"fault tolerance: step {recovered + 1}: 2 of 2 groups live" in "".join(lived)
    assert_same_weights(tmp_path / "group_0" / "model.pt", tmp_path / "group_1" / "model.pt")
    # Every rank's shards of the weights and of the optimizer's state, as each group saved them at the end
    ends = [_sharded_state(tmp_path / f"group_{g}" / "checkpoints" / f"step_{STEPS}", tmp_path / f"{g}.pt") for g in (0, 1)]
    _assert_equal(*ends)
