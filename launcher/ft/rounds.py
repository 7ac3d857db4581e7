"""A step's quorum through torchft's Manager: optimistic, overlapped with the step, synchronous only where the
groups changed.

torchft's quorum is a round trip to the lighthouse that every live group makes each step: a barrier between the
groups. A step starts it without waiting (torchft's asynchronous quorum, `optimistic`) and reads its batch as the
previous quorum left the groups; the first thing of the step that needs the quorum (the item counts' sum, the first
bucket of the gradients' average, the commit) waits for it and compares it with the previous one (`same`). The same
quorum (its id, its members, every member at the same step, this group's place in it), the common case: the step
stands, and the quorum added no barrier beside the average. Anything else (a group joined or left, one is behind and
must copy a live group's state, a step failed: torchft gives a new id after a failed commit) every member of the
quorum sees alike, so none of them averages anything: the step is dropped and started again from the same batches
after a synchronous quorum (`synchronous`), as every step's was before: a group behind copies a live group's state
before it reads a batch, and each new quorum's recipes are compared (same_recipe.py).

Both kinds heal (torchft's allow_heal: every member of a quorum must pass the same): a giver hands over its state as
it stood at the step's start (recovery.boundary) whenever torchft asks for it, and steps only after a quorum the taker
is in too; a taker keeps what it received in an optimistic quorum (torchft's pending state) and takes it before the
synchronous one (`heal`). Nothing here imports torchft: it works on the Manager it is given.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch


class Seen:
    """torchft's client of its group's manager server, keeping the last quorum it answered (its member count: the
    Manager keeps, of an optimistic quorum, only the members at the highest step). In a group of one process the
    commit vote is this process's own: the server answers a vote with its group's votes all true (torchft's
    manager.rs), so `alone` leaves out its round trip each step."""

    def __init__(self, client: Any, alone: bool):
        self.client, self.quorum, self.alone = client, None, alone

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.quorum = self.client._quorum(*args, **kwargs)
        return self.quorum

    def should_commit(self, rank: int, step: int, vote: bool, timeout: Any) -> bool:
        return bool(vote) if self.alone else self.client.should_commit(rank, step, vote, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def watch(manager: Any, alone: bool) -> None:
    """Keep the quorums `manager` gets (`members`); `alone`: its group is one process."""
    manager._client = Seen(manager._client, alone)


def start(manager: Any, synchronous: bool) -> None:
    """A quorum for the next step: `synchronous` returns once it has come, a live group's state taken where this group
    was behind (torchft's synchronous quorum); else it comes in the background (`wait`)."""
    manager._use_async_quorum = not synchronous  # read by start_quorum and its thread alone
    manager.start_quorum(allow_heal=True)


def wait(manager: Any) -> None:
    manager.wait_quorum()


def members(manager: Any) -> int:
    """How many groups the last quorum has, behind or not."""
    quorum = manager._client.quorum
    return int(quorum.replica_world_size) if quorum is not None else 0


class State(NamedTuple):
    quorum: int  # torchft's quorum id
    members: int  # groups in the quorum, behind or not
    participants: int  # those at the highest step
    place: Optional[int]  # this group's among them


def state(manager: Any) -> State:
    """What makes two quorums the same for this group: torchft's quorum id (new where the members change, or after a
    failed commit), its members, those at the highest step, this group's place among them."""
    return State(manager._quorum_id, members(manager), manager._participating_replica_world_size,
                 manager._participating_replica_rank)


def same(manager: Any, before: Optional[State]) -> bool:
    """Whether the quorum that has come is `before`'s, with every member at the same step and this group not behind:
    then a step read as `before` left the groups stands."""
    return before is not None and not manager._healing and state(manager) == before


def heal(manager: Any) -> bool:
    """Take the live group's state an optimistic quorum received, where it did (torchft's pending state: the Manager
    calls the strategy's load_state_dict with it); whether it did."""
    if not manager._healing:
        return False
    manager._apply_pending_state_dict()
    manager._healing = False
    return True


class Skipped:
    """An all-reduce not run (a dropped step's): its tensor as it was."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def wait(self) -> bool:
        return True
