"""torchft's lighthouse, in this process: the server every group asks, each step, which groups are live.

Its settings come from the recipe: a quorum needs `min_groups` groups; a group whose heartbeat (torchft's, every
0.1 s) has been silent for `timeouts.pg` is dropped, and a live group late for a step (saving a checkpoint) is
waited for as long. Both are shorter than `timeouts.quorum`, so that a step that waits for a quorum outlasts them.
The lighthouse is the run's one point of failure: lost, every group stops at its next step (exit 6).
"""

from __future__ import annotations

from typing import Any

from launcher.ft.pieces import quiet
from launcher.recipe.fault_tolerance import FaultToleranceConfig

TICK_MS = 100  # how often it checks for a quorum while it waits for groups (torchft's default)


def start(section: FaultToleranceConfig, bind: str = "[::]:0") -> Any:
    """A running lighthouse (its `.address()`: http://host:port; `.shutdown()`), on a free port by default."""
    quiet()
    from torchft._torchft import LighthouseServer

    wait_ms = int(section.timeouts.pg * 1000)
    return LighthouseServer(bind=bind, min_replicas=section.min_groups, join_timeout_ms=wait_ms,
                            quorum_tick_ms=TICK_MS, heartbeat_timeout_ms=wait_ms)
