"""One process's part in a fault-tolerant run: torchft's Manager, driven step by step by the strategy.

Each step:

1. `begin`: the groups agree which of them are live (a quorum, through the lighthouse), synchronously, before
   the step reads a batch. A group behind the others (one that joins, or one a quorum went on without) first
   copies a live group's state (recovery.py) and reads its batches from the position it took. A fresh run's
   first step waits (up to timeouts.join) for every group, so that all of them train from step 1.
2. The step's forward and backward, inside the group as its strategy does them; `arm` before the last one:
   the gradients are averaged over the live groups in buckets (average.py), each launched as that backward makes
   it (a group of one process) or once it is done (a group's own reduction first), and `wait` after it.
3. `commit`: the group steps only if torchft commits: when a group died or froze during the step, the live ones
   drop it and train it again from the same batches (the loop rewinds), so no live group's step ever goes back.

The periodic checkpoints are written by the lowest live group (`lowest_live`). Nothing here is called by a run
without fault_tolerance, and torchft is imported only here.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import time
import urllib.parse
import warnings
from typing import Any, Callable, List, Mapping, Optional

import torch

from launcher import seeding
from launcher.errors import Hung, NoQuorum, UserError, first_line
from launcher.ft import average, recovery, same_recipe
from launcher.recipe.fault_tolerance import FaultToleranceConfig

REPLICA_ID = "group_{:05d}"  # torchft sorts groups by it (lowest first) and reads its trailing digits
CONNECT = 10  # seconds a group waits for the lighthouse's port to answer at its start


def quiet(log: Optional[str] = None) -> None:
    """torchft says every quorum and commit at INFO (its Rust side on stderr, a few lines a step), and each error a
    group meets when a peer dies with its traceback: none of it reaches the console (the strategy says what
    happened, one line each). Its Python side's warnings and errors go to `log`, a file, where given; its Rust
    side's warnings stay on stderr, unless RUST_LOG says otherwise. Called before torchft is imported."""
    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
        if not logger.handlers:
            logger.addHandler(logging.FileHandler(log) if log else logging.NullHandler())
    # torch's, once per process, about the bytes torchft's HTTP transfer hands it (read-only, and copied)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _reason(e: BaseException) -> str:
    """A collective's error in a few words: gloo's start with its source file and end with advice."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", first_line(e))
    return text.split(". This is typically")[0][:160]


def _answers(lighthouse: str) -> None:
    """Something listens at the lighthouse's address (a mistyped one is one line now, not torchft's wait)."""
    found = urllib.parse.urlsplit(lighthouse)
    try:
        socket.create_connection((found.hostname, found.port or 80), timeout=CONNECT).close()
    except OSError as e:
        raise UserError(f"fault_tolerance.lighthouse: nothing answers at {lighthouse} ({e.strerror or e}); start the "
                        f"lighthouse first (python -m launcher.ft starts one and gives its address), or fix the "
                        f"address") from None


def process_group(device: str) -> type:
    """torchft's process group across the groups for gradients on `device`: its NCCL one on CUDA (abortable: a
    dead group's collective errors out after timeouts.pg rather than hanging), gloo on the CPU."""
    import torchft

    return torchft.ProcessGroupNCCL if device == "cuda" else torchft.ProcessGroupGloo


def _transport(timeout: datetime.timedelta) -> Any:
    """torchft's HTTP transfer of a live group's state (its default), without a line on stderr per request."""
    from torchft.checkpointing import HTTPTransport

    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    server = transport._server  # its handler class is made inside __init__: quieted where the server holds it
    server.RequestHandlerClass = type("Quiet", (server.RequestHandlerClass,), {"log_message": lambda *args: None})
    return transport


class Replicas:
    """This process's Manager: rank `rank` of `world` in group `group` of `section.groups`; `agree` gathers a value
    from every process of the group (its strategy's all_gather_object)."""

    def __init__(self, section: FaultToleranceConfig, group: int, rank: int, world: int, lighthouse: str,
                 fingerprint: Mapping[str, Any], agree: Callable[[Any], List[Any]], log: Optional[str] = None,
                 device: str = "cpu"):
        self.section, self.group, self.rank, self.world, self.agree = section, group, rank, world, agree
        self.device = device  # where the gradients are: the process group across the groups follows it
        self.lighthouse, self.fingerprint, self.log = lighthouse, fingerprint, log
        _answers(lighthouse)
        self.manager: Any = None  # made at the first step (see _start)
        self.live: Any = None
        self.recovered = False
        self.participants: Optional[int] = None
        self.drawn: Any = None  # the RNG states at the step's start
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
                min_replica_size=self.section.min_groups, use_async_quorum=False, init_sync=True,
                timeout=seconds(seconds=t.join), quorum_timeout=seconds(seconds=t.quorum),
                connect_timeout=seconds(seconds=t.join), rank=self.rank, world_size=self.world,
                lighthouse_addr=self.lighthouse, replica_id=REPLICA_ID.format(self.group),
                checkpoint_transport=_transport(seconds(seconds=t.join)), **store)
        except RuntimeError as e:
            raise Hung(f"fault_tolerance: group {self.group} cannot reach the lighthouse at {self.lighthouse} "
                       f"({first_line(e)}); the group stops") from None

    def begin(self, live: Any) -> bool:
        """A quorum for the step after `live.position`; True when this process took a live group's state."""
        self.live, self.recovered = live, False
        first, step = self.manager is None, live.position.step
        if first:
            self._start()  # a run resumed from a checkpoint: torchft's step count starts where it stands
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
        began = time.monotonic()
        self._quorum(step)
        if first and live.position.step == step:
            self._wait_for_every_group(live, began)
        self._same_recipe()
        # A dropped step draws again what it drew (dropout): the run stays a function of the seed, the step and
        # which groups were live.
        self.drawn = seeding.capture(recovery.device_of(live))
        if live.position.step != step:
            live.say(f"fault tolerance: recovered live from a live group at step {live.position.step} (its weights, "
                     f"optimizer, schedule, RNG and position; no checkpoint read) in {time.monotonic() - began:.2f} s")
        self._say_participants(live)
        return self.recovered

    def _quorum(self, step: int) -> None:
        try:
            self.manager.start_quorum()
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
        while self.manager.num_participants() < groups and all(self.agree(time.monotonic() < deadline)):
            if not said:
                live.say(f"fault tolerance: {self.manager.num_participants()} of {groups} groups here; the first "
                         f"step waits up to {self.section.timeouts.join:g} s (timeouts.join) for the others")
                said = True
            time.sleep(0.1)
            self._quorum(live.position.step)
        if self.manager.num_participants() < groups:
            live.say(f"fault tolerance: {self.manager.num_participants()} of {groups} groups joined within "
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
            self.averaging = average.Average(params, lambda flat: self.manager.allreduce(flat), overlap)
        self.averaging.arm()

    def wait(self) -> None:
        """After the step's last backward: the gradients are the mean over the live groups (as ddp's are at the end
        of its backward), or a failure is kept by the manager for `commit`."""
        self.averaging.wait()

    def commit(self) -> bool:
        """Whether the optimizer may step (torchft's commit): False when a group failed during the step."""
        if not self.manager.should_commit():
            why = self.manager.errored()
            self.live.say(f"fault tolerance: step {self.live.position.step + 1} dropped "
                          f"({_reason(why.original_exception) if why else 'too few groups live'}); the live groups "
                          f"train it again")
            seeding.restore(self.drawn, recovery.device_of(self.live))
            return False
        return True

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the live groups, in place (a step's item counts)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    def live_groups(self) -> int:
        return self.manager.num_participants()

    def lowest_live(self) -> bool:
        """Whether this group is the lowest of the live ones (the one that writes the periodic checkpoints)."""
        return self.manager.participating_rank() == 0

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    def _give(self) -> dict:
        return recovery.given(self.live, self.fingerprint)

    def _take(self, state: dict) -> None:
        recovery.take(state, self.live, self.fingerprint)
        self.recovered = True

