"""One process's part in a fault-tolerant run: torchft's Manager, driven step by step by the strategy.

Each step:

1. `begin`: the groups agree which of them are live (a quorum, through the lighthouse): optimistically, while the
   step reads its batch and runs its forward, as the previous quorum left the groups; where the quorum changed, the
   step is dropped before anything is averaged and started again after a synchronous quorum (rounds.py). A group
   behind the others (one that joins, or one a quorum went on without) first copies a live group's state
   (recovery.py) and reads its batches from the position it took. A fresh run's first step waits (up to
   timeouts.join) for every group, so that all of them train from step 1.
2. The step's forward and backward, inside the group as its strategy does them; `arm` before the last one:
   the gradients are averaged over the live groups in buckets (average.py), each launched as that backward makes
   it (a group of one process) or once it is done (a group's own reduction first), and `wait` after it.
3. `commit`: the group steps only if torchft commits: when a group died or froze during the step, the live ones
   drop it and train it again from the same batches (the loop rewinds), so no live group's step ever goes back.

The periodic checkpoints are written by the lowest live group (`lowest_live`). Nothing here is called by a run
without fault_tolerance.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, Callable, List, Mapping, Optional

import torch

from launcher import seeding
from launcher.errors import Hung, NoQuorum, first_line
from launcher.ft import average, recovery, rounds, same_recipe
from launcher.ft.pieces import REPLICA_ID, answers, process_group, quiet, reason, transport
from launcher.recipe.fault_tolerance import FaultToleranceConfig

class Replicas:
    """This process's Manager: rank `rank` of `world` in group `group` of `section.groups`; `agree` gathers a value
    from every process of the group (its strategy's all_gather_object)."""

    def __init__(self, section: FaultToleranceConfig, group: int, rank: int, world: int, lighthouse: str,
                 fingerprint: Mapping[str, Any], agree: Callable[[Any], List[Any]], log: Optional[str] = None,
                 device: str = "cpu"):
        self.section, self.group, self.rank, self.world, self.agree = section, group, rank, world, agree
        self.device = device  # where the gradients are: the process group across the groups follows it
        self.lighthouse, self.fingerprint, self.log = lighthouse, fingerprint, log
        answers(lighthouse)
        self.manager: Any = None  # made at the first step (see _start)
        self.live: Any = None
        self.recovered = False
        self.participants: Optional[int] = None
        self.at: Any = None  # the state a step moves on, at its start (recovery.boundary): what a taker gets
        self.drawn: Any = None  # the RNG states at the step's start
        self.seen: Optional[rounds.State] = None  # the last quorum a step stood on
        self.unsettled = False  # the step's optimistic quorum not compared yet with `seen`
        self.dropping = False  # it was, and differs: the step averages nothing and is started again
        self.again = False  # the next begin is that start again: a synchronous quorum at once
        self.failed = False  # the last step's commit failed (the next quorum is a new one)
        self.lost: Optional[BaseException] = None  # the optimistic quorum's failure, said by commit
        self.checked: Optional[int] = None  # the quorum whose members' recipes were found alike
        self.averaging: Optional[average.Average] = None  # made at the first step's last backward

    def _start(self) -> None:
        """torchft's Manager, made just before the first quorum: from then on the lighthouse counts this group
        among the live ones (a run of two groups waits for a group it counts and that has not joined a quorum
        yet, so a group that took minutes to build its model would otherwise hold the other back as long)."""
        quiet(self.log)
        from torchft import Manager

        t, seconds, store = self.section.timeouts, datetime.timedelta, {}
        if "MASTER_ADDR" not in os.environ:  # a group of one plain process: it hosts its group's store itself
            from torch.distributed import TCPStore

            self.store = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
            store = {"store_addr": socket.gethostname(), "store_port": self.store.port}
        try:
            self.manager = Manager(
                pg=process_group(self.device)(timeout=seconds(seconds=t.pg)), load_state_dict=self._take, state_dict=self._give,
                min_replica_size=self.section.min_groups, use_async_quorum=True, init_sync=True,
                timeout=seconds(seconds=t.join), quorum_timeout=seconds(seconds=t.quorum),
                connect_timeout=seconds(seconds=t.join), rank=self.rank, world_size=self.world,
                lighthouse_addr=self.lighthouse, replica_id=REPLICA_ID.format(self.group),
                checkpoint_transport=transport(seconds(seconds=t.join)), **store)
        except RuntimeError as e:
            raise Hung(f"fault_tolerance: group {self.group} cannot reach the lighthouse at {self.lighthouse} "
                       f"({first_line(e)}); the group stops") from None
        rounds.watch(self.manager, alone=self.world == 1)

    def begin(self, live: Any) -> bool:
        """A quorum for the step after `live.position`; True when this process took a live group's state. The common
        step's comes in the background (see `_settle`); a process's first step, and the step after a failed one,
        wait for theirs."""
        self.live, self.recovered = live, False
        first, step = self.manager is None, live.position.step
        if first:
            self._start()  # a run resumed from a checkpoint: torchft's step count starts where it stands
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
        began = time.monotonic()
        if self.again:  # this step's optimistic quorum found the groups changed, every member of it alike
            self.again = False
        else:
            self._round(step, synchronous=False)
            if not (first or self.failed):
                self.unsettled = True
                return False
            self._asking(step, rounds.wait)
            if rounds.same(self.manager, self.seen):
                return False
            rounds.heal(self.manager)
            if first and live.position.step == step:
                self._wait_for_every_group(live, began)
        rounds.heal(self.manager)  # what this step's optimistic quorum received, where this group was behind
        self._round(step, synchronous=True)
        self._same_recipe()
        self.seen = rounds.state(self.manager)
        if live.position.step != step:
            live.say(f"fault tolerance: recovered live from a live group at step {live.position.step} (its weights, "
                     f"optimizer, schedule, RNG and position; no checkpoint read) in {time.monotonic() - began:.2f} s")
        self._say_participants(live)
        return self.recovered

    def _round(self, step: int, synchronous: bool) -> None:
        # A dropped step draws again what it drew (dropout): the run stays a function of the seed, the step and
        # which groups were live.
        self.at = recovery.boundary(self.live)
        self.drawn = self.at["rng"]
        self._asking(step, lambda manager: rounds.start(manager, synchronous))

    def _asking(self, step: int, ask: Callable[[Any], None]) -> None:
        try:
            ask(self.manager)
        except Exception as e:  # torchft's RPC errors: a quorum that did not come, a lighthouse gone
            if type(e).__module__.startswith("launcher"):
                raise  # a recipe that does not match the live groups' (recovery.take)
            why = "timed out" if "Timeout expired" in str(e) else first_line(e)[:200]
            raise NoQuorum(f"fault_tolerance: no quorum for step {step + 1} within timeouts.quorum="
                       f"{self.section.timeouts.quorum:g} s ({why}): fewer than min_groups="
                       f"{self.section.min_groups} groups are live, or the lighthouse at {self.lighthouse} is gone; "
                       f"this group stops (each group resumes its newest checkpoint when started again)") from None

    def _same_recipe(self) -> None:
        """Every member's recipe checked against the live groups' at each new quorum, before it averages anything
        (same_recipe.py): groups that start together, or resume from checkpoints of one step, copy nothing."""
        quorum = self.manager._quorum_id  # torchft's: every member of a new quorum gets a new one alike
        if quorum != self.checked and same_recipe.check(self.manager, self.group, self.fingerprint,
                                                        trained=self.manager.batches_committed() > 0):
            self.checked = quorum

    def _wait_for_every_group(self, live: Any, began: float) -> None:
        """A fresh run's first step: quorums again until every group is in one (or timeouts.join has passed). The
        processes of a group agree on each round (their quorum requests go together), a deadline included."""
        groups, deadline = self.section.groups, began + self.section.timeouts.join
        said = False
        while rounds.members(self.manager) < groups and all(self.agree(time.monotonic() < deadline)):
            if not said:
                live.say(f"fault tolerance: {rounds.members(self.manager)} of {groups} groups here; the first "
                         f"step waits up to {self.section.timeouts.join:g} s (timeouts.join) for the others")
                said = True
            time.sleep(0.1)
            # optimistic quorums, waited for: a group that comes meanwhile is in one with those here, whichever
            # kind its own first is, and all of them go on to the synchronous one together
            self._round(live.position.step, synchronous=False)
            self._asking(live.position.step, rounds.wait)
            rounds.heal(self.manager)
        if rounds.members(self.manager) < groups:
            live.say(f"fault tolerance: {rounds.members(self.manager)} of {groups} groups joined within "
                     f"{self.section.timeouts.join:g} s; training starts with them (the others join live)")

    def _say_participants(self, live: Any) -> None:
        now = self.manager.num_participants()
        if now != self.participants and self.participants is not None:
            live.say(f"fault tolerance: step {live.position.step + 1}: {now} of {self.section.groups} groups live")
        self.participants = now

    def arm(self, params: List[torch.Tensor], overlap: bool) -> None:
        """The next backward is the step's last: its gradients are averaged over the live groups in buckets, launched
        as the backward makes them where `overlap` (a group of one process), else by `wait` once it is done."""
        if self.averaging is None:  # (DDP's bucket sizes, not the recipe's ddp.bucket_cap_mb: every group must cut
            # its buckets alike, and that key is not among those a joining group is checked against)
            self.averaging = average.Average(params, self._average, overlap)
        self.averaging.arm()

    def _settle(self) -> None:
        """The step's optimistic quorum, waited for where it has not come yet, and compared with the one the previous
        step stood on: before the step's first all-reduce across the groups, each member of the quorum alike. A
        failure is said by `commit` (this may run inside the backward: the average's first bucket)."""
        if not self.unsettled:
            return
        self.unsettled = False
        try:
            self._asking(self.live.position.step, rounds.wait)
        except NoQuorum as e:
            self.lost, self.dropping = e, True
            return
        self.dropping = not rounds.same(self.manager, self.seen)

    def _average(self, flat: torch.Tensor) -> Any:
        self._settle()
        return rounds.Skipped(flat) if self.dropping else self.manager.allreduce(flat)

    def wait(self) -> None:
        """After the step's last backward: the gradients are the mean over the live groups (as ddp's are at the end
        of its backward), or a failure is kept by the manager for `commit`."""
        self.averaging.wait()

    def _raise_lost(self) -> None:
        """No quorum came for this step: the group stops with its state as at the step's start, whole (saved), the
        position and RNG it moved on put back (and a stream's place, by the strategy)."""
        if self.lost is not None:
            lost, self.lost = self.lost, None
            seeding.restore(self.drawn, recovery.device_of(self.live))
            vars(self.live.position).update(self.at["position"])
            raise lost

    def commit(self) -> bool:
        """Whether the optimizer may step (torchft's commit): False when a group failed during the step, or when the
        step's optimistic quorum found the groups changed (it is started again after a synchronous one)."""
        self._settle()
        self._raise_lost()
        if self.dropping:
            self.dropping, self.again = False, True
            now = rounds.members(self.manager)
            if self.seen is not None and now < self.seen.members:  # a group gone (a join drops its step unsaid)
                self.live.say(f"fault tolerance: step {self.live.position.step + 1} started again ({now} of "
                              f"{self.seen.members} groups in its quorum); the live groups train it again")
            seeding.restore(self.drawn, recovery.device_of(self.live))
            return False
        self.failed = not self.manager.should_commit()
        if self.failed:
            why = self.manager.errored()
            self.live.say(f"fault tolerance: step {self.live.position.step + 1} dropped "
                          f"({reason(why.original_exception) if why else 'too few groups live'}); the live groups "
                          f"train it again")
            seeding.restore(self.drawn, recovery.device_of(self.live))
            return False
        return True

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the live groups, in place (a step's item counts)."""
        from torch.distributed import ReduceOp

        self._settle()
        if not self.dropping:
            self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    def live_groups(self) -> int:
        self._settle()
        return self.participants if self.dropping and self.participants else self.manager.num_participants()

    def lowest_live(self) -> bool:
        """Whether this group is the lowest of the live ones (the one that writes the periodic checkpoints)."""
        self._settle()
        return not self.dropping and self.manager.participating_rank() == 0

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    def _give(self) -> dict:
        return recovery.given(self.live, self.fingerprint, self.at)

    def _take(self, state: dict) -> None:
        recovery.take(state, self.live, self.fingerprint)
        self.recovered = True

