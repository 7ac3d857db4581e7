"""A step for the fault tolerance tests: it takes a set time, so that a group's steps come at a pace the test can
act between (start a group again while another trains), whatever the machine's speed; and it kills its own
process with SIGKILL in the forward of a chosen step, where the environment asks (FT_TEST_DIE=<group>:<step>,
read with REPLICA_GROUP_ID, which python -m launcher.ft gives each group): a failure at a step known in advance,
so that runs can be compared step for step."""

from __future__ import annotations

import os
import signal
import time

_trained = 0  # forwards in training mode (the first-batch check runs one in eval mode)


def paced_step(model, batch, loss, seconds: float = 0.02):
    """The supervised step, after `seconds` of sleep (no CPU used)."""
    global _trained
    time.sleep(seconds)
    x, y = batch
    if model.training:
        _trained += 1
        group, _, step = os.environ.get("FT_TEST_DIE", "").partition(":")
        if group and group == os.environ.get("REPLICA_GROUP_ID") and _trained == int(step):
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the forward of that step, before its all-reduce
    output = model(x)
    return {"loss": loss(output, y), "output": output, "target": y}


def counted_step(model, batch, loss):
    """A step that counts its items, and not every item: only those of the first five classes are targets
    (a share of each batch that differs from batch to batch and from group to group, as a text batch's
    labels do). `loss` is a per-item loss (reduction: none)."""
    x, y = batch
    output = model(x)
    kept = (y < 5).float()
    return {"loss": (loss(output, y) * kept).sum() / kept.sum().clamp(min=1), "num_items": kept.sum(),
            "output": output, "target": y}
