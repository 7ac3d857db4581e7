"""A step for the fault tolerance tests: it takes a set time, so that a group's steps come at a pace the test can
act between (start a group again while another trains), whatever the machine's speed; and it kills its own
process with SIGKILL at a chosen point of a chosen step, where the environment asks: a failure known in advance,
so that runs can be compared step for step.

    FT_TEST_DIE=<group>:<n>[:<point>[:<rank>]][,<group>:<n>[:<point>[:<rank>]] ...]

read with REPLICA_GROUP_ID (which python -m launcher.ft and the Slurm jobs give each group), by a process's
first start only (a Slurm task requeued, SLURM_RESTART_COUNT > 0, trains on). Every process of the group dies,
or the one of that rank inside its group alone (RANK, torchrun's). `n` counts this process's training
forwards (a dropped step's forward counts again), so it is the step's number while no step was dropped before
it; for `save` it is the step whose checkpoint is being written. The points of a step, in their order:

    forward     in the step's forward, before its all-reduce
    backward    in its backward (the hook of the output's gradient)
    allreduce   once the gradients' all-reduce across groups has started (torchft's Manager.allreduce)
    optimizer   after the groups committed the step, before this group's optimizer steps
    save        writing the step's periodic checkpoint: model.pt written, state.pt not yet, no manifest

A group that lost a peer group trains on alone; a test then starts the lost group again, which takes as long as
the machine makes it (seconds, or a minute when it is busy). So that the live groups neither finish nor outrun it
meanwhile, whatever that takes:

    FT_TEST_HOLD=<k>[:<file>]

makes a group that has trained k steps with fewer groups live than it had hold before its next step, asking the
lighthouse for a quorum again and again (as a fresh run's first step does), until a quorum has more groups (the
lost one is back) or `file` exists (the test releases it: a group that comes back only to be refused). Holding
changes nothing a step trains: the run is the same function of the seed, the steps and the groups live at each. And

    FT_TEST_ROUNDS=<path>

writes a line to <path>.<group> for each quorum the group starts: torchft's step count and its kind (synchronous:
the step waits for it; optimistic: it comes during the step, launcher/ft/rounds.py), and for each commit vote a
process of the group asks its manager server for: the step and `vote` (a group of one process asks none).
"""

from __future__ import annotations

import os
import signal
import time

POINTS = ("forward", "backward", "allreduce", "optimizer", "save")
_trained = 0  # forwards in training mode (the first-batch check runs one in eval mode)


def _asked() -> tuple:
    """(the forward, the point) at which this group dies, or (0, '') where it does not."""
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0):
        return 0, ""
    for one in filter(None, os.environ.get("FT_TEST_DIE", "").split(",")):
        group, n, *point = one.split(":")
        rank = point[1] if len(point) > 1 else os.environ.get("RANK", "0")
        if group == os.environ.get("REPLICA_GROUP_ID") and rank == os.environ.get("RANK", "0"):
            assert not point or point[0] in POINTS, f"FT_TEST_DIE: {one}: the points are {POINTS}"
            return int(n), (point[0] if point else "forward")
    return 0, ""


DIES_AT, POINT = _asked()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _now(point: str) -> bool:
    return POINT == point and _trained == DIES_AT


def _install() -> None:
    """The hooks of the points outside the step's own code (this module is imported once per group process,
    when its recipe's step is built)."""
    if POINT == "allreduce":
        from torchft import Manager

        started = Manager.allreduce

        def allreduce(self, tensor, *args, **kwargs):
            work = started(self, tensor, *args, **kwargs)
            if _now("allreduce"):
                _die()
            return work

        Manager.allreduce = allreduce
    elif POINT == "optimizer":
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: _die() if _now("optimizer") else None)
    elif POINT == "save":
        from launcher.checkpoint import files

        written = files.save

        def save(path, obj, atomic=False):
            if path.name == "state.pt" and path.parent.name == f".step_{DIES_AT}.partial":
                _die()
            return written(path, obj, atomic)

        files.save = save


def _hold() -> None:
    """FT_TEST_HOLD's quorums again, in front of torchft's Manager.start_quorum."""
    asked = os.environ.get("FT_TEST_HOLD")
    if not asked:
        return
    k, _, release = asked.partition(":")
    from torchft import Manager

    quorum = Manager.start_quorum
    seen = {"most": 0, "short_since": None}

    def members(manager) -> int:  # every group of the quorum, behind or not (launcher/ft/rounds.py)
        manager.wait_quorum()
        return manager._client.quorum.replica_world_size

    def start_quorum(self, *args, **kwargs):
        quorum(self, *args, **kwargs)
        now = members(self)
        if now >= seen["most"]:
            seen["most"], seen["short_since"] = now, None
            return
        if seen["short_since"] is None:
            seen["short_since"] = self.current_step()
        # (the processes of a group get the same quorums, so they hold alike, for as many rounds)
        for _ in range(6000):  # at most about 10 minutes: a test that fails ends rather than hangs
            if self.current_step() - seen["short_since"] < int(k) or members(self) > now or \
                    (release and os.path.exists(release)):
                return
            time.sleep(0.1)
            quorum(self, *args, **kwargs)

    Manager.start_quorum = start_quorum


def _rounds() -> None:
    """FT_TEST_ROUNDS=<path>: each quorum this group starts, a line in <path>.<group>: torchft's step count and
    whether it waits for the quorum before it returns (synchronous) or lets it come during the step (optimistic)."""
    asked = os.environ.get("FT_TEST_ROUNDS")
    if not asked:
        return
    from torchft import Manager

    quorum = Manager.start_quorum

    def start_quorum(self, *args, **kwargs):
        with open(f"{asked}.{os.environ.get('REPLICA_GROUP_ID')}", "a") as out:
            out.write(f"{self.current_step()} {'optimistic' if self._use_async_quorum else 'synchronous'}\n")
        return quorum(self, *args, **kwargs)

    Manager.start_quorum = start_quorum
    made = Manager.__init__

    def __init__(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self._client = _Votes(self._client, f"{asked}.{os.environ.get('REPLICA_GROUP_ID')}")

    Manager.__init__ = __init__


class _Votes:
    """torchft's client of the group's manager server, each commit vote it is asked for written down."""

    def __init__(self, client, path: str):
        self.client, self.path = client, path

    def should_commit(self, rank, step, vote, *args, **kwargs):
        with open(self.path, "a") as out:
            out.write(f"{step} vote\n")
        return self.client.should_commit(rank, step, vote, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


_install()
_rounds()
_hold()


def paced_step(model, batch, loss, seconds: float = 0.02):
    """The supervised step, after `seconds` of sleep (no CPU used)."""
    global _trained
    time.sleep(seconds)
    x, y = batch
    if model.training:
        _trained += 1
        if _now("forward"):
            _die()  # mid-step: the forward of that step, before its all-reduce
    output = model(x)
    if model.training and _now("backward"):
        output.register_hook(lambda grad: _die())
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
