"""Every group's recipe checked against the live groups' at each new quorum, before the quorum averages anything.

A group that joins behind the others is checked as it copies their state (recovery.take); but groups that start
together, or resume from checkpoints of one step, copy nothing. So each time the groups of a quorum change (a new
quorum id: torchft gives one to every member of a new quorum alike, and after any failed step), each member hands
the others its fingerprint (settings.fingerprint) through the quorum's own process group: one all-reduce of a row
per group (whether it trained already, its index, its fingerprint's length and SHA-256), and only where the digests
differ a second one of the fingerprints themselves, to name the keys. Then:

a group whose recipe differs from the live groups' is refused in one line naming the keys (exit 2), and they train
on: the step it was in is dropped, as for any group lost during a step. The live groups are those that trained a
step already; where none did (groups resumed from checkpoints of one step), the lowest group of the quorum, as
torchft's first quorum of a fresh run makes the others copy the lowest group's state (and recovery.take check it).

Rank r of a group compares with rank r of the others: each rank of a group holds the same fingerprint and sees the
same rows, so every rank of a group decides alike.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, List, Mapping, Optional, Tuple

import torch

from launcher.errors import UserError
from launcher.ft import settings

DIGEST = 32  # bytes of a SHA-256
Row = Tuple[bool, int, dict]  # (trained already, group, fingerprint)


def normal(fingerprint: Mapping[str, Any]) -> dict:
    """The fingerprint as it travels (JSON: lists for tuples), so that two groups' compare as they arrive."""
    return json.loads(_text(fingerprint))


def _text(fingerprint: Mapping[str, Any]) -> str:
    return json.dumps(dict(fingerprint), sort_keys=True, default=str)


def exchange(manager: Any, group: int, fingerprint: Mapping[str, Any], trained: bool) -> Optional[List[Row]]:
    """Every member's row of this quorum, by its place in it; [] where all fingerprints are alike (or this group is
    alone); None where the exchange failed (a peer lost during it: the step is dropped, and the next quorum, a new
    one, exchanges again)."""
    from torch.distributed import ReduceOp

    count, me = manager.num_participants(), manager.participating_rank()
    if count < 2 or me is None:
        return []
    text = _text(fingerprint).encode()
    rows = torch.zeros(count, 3 + DIGEST, dtype=torch.int64)
    rows[me, :3] = torch.tensor([1 + int(trained), group, len(text)])  # 0: a member that handed nothing
    rows[me, 3:] = torch.tensor(list(hashlib.sha256(text).digest()))
    manager.allreduce(rows, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    if all(torch.equal(rows[r, 3:], rows[me, 3:]) for r in range(count)):
        return []
    texts = torch.zeros(count, int(rows[:, 2].max()), dtype=torch.int64)
    texts[me, :len(text)] = torch.tensor(list(text))
    manager.allreduce(texts, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    return [(int(rows[r, 0]) == 2, int(rows[r, 1]), json.loads(bytes(texts[r, :int(rows[r, 2])].tolist())))
            for r in range(count) if int(rows[r, 0])]


def refusal(rows: List[Row], fingerprint: Mapping[str, Any]) -> Optional[str]:
    """The line this group stops with, or None where it trains on with the others."""
    theirs = next((row for row in rows if row[0]), rows[0])[2]  # those that trained, else the lowest group's
    return settings.refused(normal(fingerprint), theirs)


def check(manager: Any, group: int, fingerprint: Mapping[str, Any], trained: bool) -> bool:
    """Exchange and decide: True where done (alike, or alone), False where the exchange failed; raises UserError
    where this group's recipe is refused."""
    rows = exchange(manager, group, fingerprint, trained)
    if rows is None:
        return False
    refused = refusal(rows, fingerprint) if rows else None
    if refused:
        raise UserError(refused)
    return True
