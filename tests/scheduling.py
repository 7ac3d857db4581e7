"""pytest-xdist's loadgroup, with a worker kept for the tests that mostly wait.

The Slurm jobs spend most of their minutes waiting on the local cluster (46 CPU s in 212 s measured on
two cores): on one of two workers they held a core's worth of the run idle. With three workers or more,
the last one (the waiter) runs the WAITING groups, and the others never do. The tests that measure
(group MEASURING: the benchmark's rows, host memory) go first, to one of the others, and while they run
the waiter takes nothing else: they measure beside one other worker, as they always did (a third
CPU-bound worker made a benchmark row's ratio 11 where it is about 0.8). Once they are done, the waiter
takes tests like the others, filling the time the tests spend waiting on their processes. With fewer
workers this is loadgroup as it is.
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

WAITING = {"slurm"}  # groups given by tests/conftest.py
MEASURING = "measuring"


class WaitingApart(LoadGroupScheduling):
    waiter = None  # the gateway id of the worker that runs WAITING, decided when the run is scheduled

    def schedule(self) -> None:
        if self.collection is None and len(self.nodes) >= 3:
            self.waiter = max((node.gateway.id for node in self.nodes), key=lambda name: int(name.lstrip("gw") or 0))
        super().schedule()

    def _measuring(self) -> bool:
        """Whether tests that measure are still to run or running."""
        return MEASURING in self.workqueue or any(
            not done for work in self.assigned_work.values() for done in work.get(MEASURING, {}).values())

    def _takes(self, node, scope: str) -> bool:
        if self.waiter is None:
            return True
        if node.gateway.id != self.waiter:
            return scope not in WAITING
        return scope in WAITING or (scope != MEASURING and not self._measuring())

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        waiting_left = self.waiter is not None and node.gateway.id != self.waiter and all(s in WAITING for s in self.workqueue)
        if not self.workqueue or waiting_left:
            node.shutdown()  # nothing left that this worker runs: it ends once its own tests are done
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)  # the waiter, while tests measure, takes nothing and stays

    def _assign_work_unit(self, node) -> None:
        takes = [scope for scope in self.workqueue if self._takes(node, scope)]
        if takes:
            scope = MEASURING if MEASURING in takes else takes[0]  # what measures first
            self.workqueue.move_to_end(scope, last=False)  # the unit loadgroup hands out next
            super()._assign_work_unit(node)

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        # The others are looked at again too: the waiter got nothing while tests measured, and a worker holds its
        # last test back until it is sent more work or told to stop, so it may never complete one to be asked.
        for other in self.nodes:
            if other is not node:
                self._reschedule(other)
