"""pytest-xdist's loadgroup, with a worker kept for the tests that mostly wait.

The Slurm jobs spend most of their three minutes waiting on the local cluster (46 CPU s in 212 s measured
on two cores): on one of two workers they held a core's worth of the run idle. With three workers or more,
the last one runs the WAITING groups and nothing else, and the others never run them: the CPU-bound tests
keep two workers on two cores (a third CPU-bound one made the benchmark's measured runs share a core), and
the waiting happens beside them. With fewer workers this is loadgroup as it is.

Tried on 2026-11-27: the measuring group first, and the waiter taking tests like the others once it was done
(571f54a). A fresh clone took 1107 s of pytest, between this version's 965 s before it and 1307 s after it, on a
machine whose speed drifted that hour: not shown better, so not kept. Beside the Slurm packages' install, which
the waiter does first on a fresh machine, the benchmark's rows took up to twice as long (162 s against 88 s).
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

WAITING = {"slurm"}  # groups given by tests/conftest.py


class WaitingApart(LoadGroupScheduling):
    waiter = None  # the gateway id of the worker that runs WAITING, decided when the run is scheduled

    def schedule(self) -> None:
        if self.collection is None and len(self.nodes) >= 3:
            self.waiter = max((node.gateway.id for node in self.nodes), key=lambda name: int(name.lstrip("gw") or 0))
        super().schedule()

    def _takes(self, node, scope: str) -> bool:
        others = [other for other in self.nodes if other.gateway.id != self.waiter]
        if self.waiter is None or len(others) == len(self.nodes) or not others:
            # A waiter gone (crashed, or shut down as a worker more than the run's groups need): what it left, any
            # worker runs. A waiter left alone (loadgroup shut the others down: a run of one group, a module run
            # by itself) runs everything, rather than none running it.
            return True
        return (scope in WAITING) == (node.gateway.id == self.waiter)

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if not any(self._takes(node, scope) for scope in self.workqueue):
            node.shutdown()  # nothing left that this worker runs: it ends once its own tests are done
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)

    def _assign_work_unit(self, node) -> None:
        scope = next((scope for scope in self.workqueue if self._takes(node, scope)), None)
        if scope is not None:
            self.workqueue.move_to_end(scope, last=False)  # the unit loadgroup hands out next
            super()._assign_work_unit(node)
