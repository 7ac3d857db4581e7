"""The failure the fault tolerance row injects: a step that kills its own process with SIGKILL in the forward of
a chosen step, where the environment asks, so that a fault-tolerant run and a restarted one lose the same step.

    BENCH_FT_DIE=group<G>:<n>   the process of replica group G (REPLICA_GROUP_ID) dies in its n-th training forward
    BENCH_FT_DIE=rank<R>:<n>    the process of global rank R (RANK, as torchrun gives it) does

`n` counts this process's training forwards (the first-batch check's, in eval mode, is not one), so it is the
step's number in a run that starts at step 0 and drops no step before it. Only the run the bench starts with the
variable dies: the group started again and the run resumed are started without it. Otherwise the step is the
supervised one, `loss(model(x), y)`.
"""

from __future__ import annotations

import os
import signal

VARIABLE = "BENCH_FT_DIE"
_trained = 0


def _asked() -> int:
    """The forward in which this process dies, or 0."""
    who, _, n = os.environ.get(VARIABLE, "").partition(":")
    mine = {f"group{os.environ['REPLICA_GROUP_ID']}" if "REPLICA_GROUP_ID" in os.environ else None,
            f"rank{os.environ['RANK']}" if "RANK" in os.environ else None}
    return int(n) if who in mine else 0


DIES_AT = _asked()


def step(model, batch, loss):
    global _trained
    x, y = batch
    if model.training:
        _trained += 1
        if _trained == DIES_AT:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: before the gradients' all-reduce
    return loss(model(x), y)
