"""Fault tolerance around a strategy: the recipe's strategy inside a replica group (one process, or ddp or fsdp
under torchrun, fsdp with its tp and dp_replicate), torchft's quorum and gradient average across the groups
(launcher/ft/): HSDP's replicate dimension made fault tolerant, each rank averaging its gradient shards with the
same rank of the other live groups.

`around(cls, ...)` is `cls` with the few methods fault tolerance changes in front of it: the data share (this
group's of every batch), the step's start (a quorum, maybe a live recovery), its last micro-batch (the gradients
averaged over the live groups in buckets, with its backward), its commit (torchft's vote), the item counts summed
across groups, and who writes the periodic checkpoints. The rest (wrapping, no_sync, state dicts, collectives
inside the group) stays the inner strategy's. This module, and so torchft, is imported only when a recipe has a
fault_tolerance section.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, List, Optional, Tuple

import torch

from launcher.errors import NoQuorum
from launcher.ft import settings
from launcher.recipe.fault_tolerance import FaultToleranceConfig
from launcher.strategies.base import Live, Strategy


class FaultTolerant:
    """Mixed in front of a Strategy class (see `around`)."""

    section: FaultToleranceConfig
    recipe: Any  # the resolved recipe: its training keys are the fingerprint a joining group is checked against
    replicas: Any = None  # launcher.ft.replicas.Replicas, once set up
    leaving: Any = None  # launcher.ft.leaving.Watch, in a group of several processes
    stream: Any = None  # data.train where it is a stream (launcher.data.stream.StreamData), and its place at the
    place: Any = None  # step's start
    group = 0

    def setup(self) -> None:
        self.group = settings.group_index(self.section, os.environ)  # its mistakes before any process group starts
        lighthouse = settings.lighthouse_address(self.section, os.environ)
        super().setup()
        from launcher.ft.replicas import Replicas  # torchft

        fingerprint = settings.fingerprint(self.recipe, self.placement.world_size, self.layout())
        self.replicas = Replicas(self.section, self.group, self.placement.rank, self.placement.world_size,
                                 lighthouse, fingerprint, self.all_gather_object, self._log(), self.device.type)
        if self.placement.world_size > 1:  # a process of the group lost: the group leaves at once (ft/leaving.py)
            from launcher.ft import leaving

            peers = self.all_gather_object((socket.gethostname(), os.getpid()))
            self.leaving = leaving.watch(peers, self.placement.rank, self.group)

    def _log(self) -> Optional[str]:
        """<run_dir>/torchft_rank<R>.log: torchft's own warnings and errors (a peer's failure, with its traceback)."""
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except (OSError, TypeError):  # no run folder, or one that cannot be written (the run folder says so next)
            return None
        return os.path.join(self.run_dir, f"torchft_rank{self.placement.rank}.log")

    def notes(self) -> List[str]:
        t = self.section.timeouts
        return super().notes() + [
            f"fault tolerance: group {self.group} of {self.section.groups} (process {os.getpid()}), lighthouse "
            f"{self.replicas.lighthouse}, at least {self.section.min_groups} live per step; timeouts pg {t.pg:g} s < "
            f"quorum {t.quorum:g} s < join {t.join:g} s"]

    def data_share(self) -> Tuple[int, int]:
        return settings.share(self.group, self.section.groups, super().data_share())

    def gradient_share(self) -> int:
        return super().data_share()[0] * self.replicas.live_groups()

    def trained_share(self) -> float:
        return self.replicas.live_groups() / self.section.groups

    def val_share(self) -> Tuple[int, int]:
        # Each group evaluates the whole of data.val among its own processes: its val/loss is the run's (the groups'
        # weights are alike), whichever groups are live, and no collective across groups runs outside a step
        return super().data_share()

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        # Over this group's ranks alone (each group logs its own share): the inner strategy's mean would divide
        # its ranks' sum by data_share's count, every group's ranks.
        return super().all_reduce_sum(tensor) / super().data_share()[0]

    def sum_counts(self, count: torch.Tensor) -> torch.Tensor:
        return self.replicas.sum(super().all_reduce_sum(count))

    def begin_step(self, live: Live) -> bool:
        recovered = self.replicas.begin(live)
        # A stream's place at the step's start: a dropped step is read again from it (a sampler's position is
        # enough for map-style data)
        self.stream = live.data if getattr(live.data, "is_stream", False) else None
        self.place = self.stream.state() if self.stream is not None else None
        return recovered

    def train_batch(self, model: Any, step: Any, batch: Any, precision: Any, weights: Any, last: bool,
                    before_backward: Any) -> List[Tuple[Any, ...]]:
        if last:  # overlapped with the backward where a group is one process: no reduction inside it, so each
            # gradient is final as the backward makes it
            params = [q for q in model.parameters() if q.requires_grad]
            self.replicas.arm(params, overlap=self.placement.world_size == 1 and self.layout() == "whole")
        done = super().train_batch(model, step, batch, precision, weights, last, before_backward)
        if last:  # averaged before the loss weights' rescale, as ddp's gradients are
            self.replicas.wait()
        return done

    def commit(self, params: List[torch.Tensor]) -> bool:
        try:
            if self.replicas.commit():
                return True
        except NoQuorum:  # the step's quorum never came: the group stops, saved as at the step's start
            if self.stream is not None:
                self.stream.restart_at(self.place)
            raise
        if self.stream is not None:
            self.stream.restart_at(self.place)
        return False

    def data_states(self, state: Any) -> List[Any]:
        # Every data-parallel rank's place, of every group (a checkpoint of a group is an ordinary one): the
        # others' are this group's own places as theirs (data/share.py: joined_place's rule, the resume's own)
        own = super().data_states(state)
        elsewhere = [p if not isinstance(p, dict) or p.get("split") != "own" else {**p, "dataset": None} for p in own]
        return [place for g in range(self.section.groups) for place in (own if g == self.group else elsewhere)]

    def writes_checkpoints(self) -> bool:
        return self.replicas.lowest_live()

    def teardown(self) -> None:
        if self.leaving is not None:
            self.leaving.close()
        if self.replicas is not None:
            self.replicas.close()
        super().teardown()


_classes: Dict[type, type] = {}


def around(cls: type, section: FaultToleranceConfig, recipe: Any):
    """A factory of `cls` strategies made fault tolerant by `section`, checked against `recipe`."""
    if cls not in _classes:
        _classes[cls] = type(f"FaultTolerant{cls.__name__}", (FaultTolerant, cls), {})
    made = _classes[cls]

    def create(*args: Any) -> Strategy:
        strategy = made(*args)
        strategy.section, strategy.recipe = section, recipe
        return strategy

    return create
