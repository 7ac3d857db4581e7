"""The recipe's `fault_tolerance:` section: replica groups that train on when one of them dies (torchft).

Null by default: the run is what it is without it, and torchft is never imported. Set, the run is one of
`groups` replica groups; each trains the recipe's layout inside itself (one process, ddp, or fsdp with its
parallel.tp and parallel.dp_replicate, under torchrun), and the groups average their gradients through torchft
every step (each rank with the same rank of the others, which holds the same shards), agreeing first (a quorum,
through the lighthouse) which of them are live. `python -m launcher.ft` starts the lighthouse and every group on
one machine (docs/fault-tolerance.md).

The timeouts nest, each longer than the one before, so that a shorter wait gives up (and the live groups go
on) before a longer one ends the run: a collective across groups (`pg`) < a step's wait for a quorum
(`quorum`) < a group's join, live copy included (`join`) < a collective inside a group (`dist_timeout`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

from launcher.errors import short
from launcher.recipe.checks import at_least, positive

# The strategies a group runs inside itself (fsdp with its tp and dp_replicate too); pipeline stages inside a
# group are later work (docs/fault-tolerance.md says what is built).
INSIDE_A_GROUP = ("auto", "single", "ddp", "fsdp")
# torchft's form: http://host:port, an IPv6 host in brackets (http://[::1]:29510), as in any URL
LIGHTHOUSE = re.compile(r"https?://(?:[^\s/:\[\]@?#]+|\[[0-9A-Fa-f:.]+\])(?::(\d+))?/?")


def lighthouse_problem(address: str) -> Optional[str]:
    """What is wrong with a lighthouse's address, or None: the form, then the port's range."""
    found = LIGHTHOUSE.fullmatch(address)
    if not found:
        return (f"must be the lighthouse's http://host:port (an IPv6 host in brackets, http://[::1]:29510), got "
                f"{short(address)}")
    port = found.group(1)
    if port is not None and not 1 <= int(port) <= 65535:
        return f"the port of {short(address)} must be 1 to 65535, got {int(port)}"
    return None


@dataclass
class FaultToleranceTimeouts:
    """How long each wait of a fault-tolerant run lasts, in seconds; pg < quorum < join < dist_timeout."""

    pg: float = 30.0  # a collective across groups (the gradients' all-reduce) waits this long for a group that died or froze; the step is then dropped and trained again by the live groups (the lighthouse also drops a group silent this long)
    quorum: float = 60.0  # a step waits this long for fault_tolerance.min_groups live groups to agree (a quorum), then the group stops (exit 6)
    join: float = 120.0  # a group may take this long to join: reach the lighthouse and its peers and copy a live group's state (a live group serving the copy waits as long); a fresh run's first step waits as long for every group


@dataclass
class FaultToleranceConfig:
    """Replica groups (torchft): the run is one of `groups`, which average their gradients every step."""

    groups: int = 2  # replica groups in the run; each reads its share of every global batch
    group: Optional[int] = None  # this group's index, 0 .. groups-1; null: REPLICA_GROUP_ID from the environment (python -m launcher.ft sets it)
    lighthouse: Optional[str] = None  # the lighthouse's address, http://host:port; null: TORCHFT_LIGHTHOUSE from the environment (python -m launcher.ft starts one and sets it)
    min_groups: int = 1  # live groups a step needs: with fewer the step waits for them (up to timeouts.quorum)
    timeouts: FaultToleranceTimeouts = field(default_factory=FaultToleranceTimeouts)

    def problems(self, strategy: str, dist_timeout: float, pp: int = 1) -> List[tuple[str, str]]:
        out = at_least("fault_tolerance.groups", self.groups, 1) + at_least("fault_tolerance.group", self.group, 0)
        if self.group is not None and self.groups >= 1 and self.group >= self.groups:
            out.append(("fault_tolerance.group", f"is an index among fault_tolerance.groups={self.groups} groups: "
                                                 f"0 to {self.groups - 1}, got {self.group}"))
        out += at_least("fault_tolerance.min_groups", self.min_groups, 1)
        if self.min_groups > self.groups >= 1:
            out.append(("fault_tolerance.min_groups", f"must be at most fault_tolerance.groups ({self.groups}), "
                                                      f"got {self.min_groups}"))
        wrong = lighthouse_problem(str(self.lighthouse)) if self.lighthouse is not None else None
        if wrong:
            out.append(("fault_tolerance.lighthouse", wrong))
        if strategy not in INSIDE_A_GROUP:
            out.append(("strategy", f"fault_tolerance runs strategy single, ddp or fsdp inside a group (auto picks "
                                    f"single or ddp), got {short(strategy)}; use one of them, or remove "
                                    f"fault_tolerance"))
        elif pp > 1:
            out.append(("parallel.pp", f"fault_tolerance runs no pipeline stages inside a group (not built yet), got "
                                       f"parallel.pp={pp}; set parallel.pp=1 (fsdp with parallel.tp and dp_replicate "
                                       f"runs inside a group), or remove fault_tolerance"))
        return out + timeout_problems(self.timeouts, dist_timeout)


def timeout_problems(t: FaultToleranceTimeouts, dist_timeout: float) -> List[tuple[str, str]]:
    """Each timeout a positive number of seconds, and their order, in one line naming the keys."""
    named = {"fault_tolerance.timeouts.pg": t.pg, "fault_tolerance.timeouts.quorum": t.quorum,
             "fault_tolerance.timeouts.join": t.join}
    bad = [(key, f"must be a positive number of seconds, got {short(value)}") for key, value in named.items()
           if not positive(value)]
    if bad:
        return bad
    chain = [*named.items(), ("dist_timeout", dist_timeout)]
    if all(a[1] < b[1] for a, b in zip(chain, chain[1:])):
        return []
    order = " < ".join(f"{key.rsplit('.', 1)[-1] if key != 'dist_timeout' else key} ({value:g})" for key, value in chain)
    return [("fault_tolerance.timeouts", f"must grow in this order, each longer than the one before: {order} does "
                                         f"not; a shorter wait must give up (and the live groups go on) before a longer "
                                         f"one ends the run (docs/fault-tolerance.md#timeouts)")]
