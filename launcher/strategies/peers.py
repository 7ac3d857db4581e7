"""What the ranks of a run learn of each other outside their collectives: a user mistake that only one rank met,
or another rank's failure, marked in the run's c10d store (under torchrun its agent hosts it, so it outlives the
ranks), so that a rank whose collective fails because a peer has gone says why in one line; every rank's
problems gathered into one; the largest of a few ints over every rank, through the host."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional, TypeVar

import torch

from launcher.errors import PeerFailed, UserError
from launcher.placement.scheduler import Placement

T = TypeVar("T")
MISTAKE_KEY = "launcher/mistake"  # in the run's c10d store: the rank that stopped for a user mistake
FAILED_KEY = "launcher/failed"  # the first rank that stopped for any other error
STORE_SECONDS = 5.0


def raise_any(everyone: List[List[str]]) -> None:
    """Every rank's problems, gathered: if any rank met one, a UserError on every rank (rank 0's lists every
    rank's problems, others' prefixed with their rank, each problem once, by its first rank)."""
    if not any(everyone):
        return
    said, seen = list(everyone[0]), set(everyone[0])
    for rank, theirs in enumerate(everyone[1:], start=1):
        said += [f"[rank {rank}] {p}" for p in theirs if p not in seen]
        seen.update(theirs)
    raise UserError(*said, agreed=True)


@contextlib.contextmanager
def shared(placement: Placement) -> Iterator[None]:
    """Strategy.mistakes_shared: this rank's own mistake marked before it leaves; a failed collective explained
    by a peer's mark."""
    if placement.world_size == 1:
        yield
        return
    try:
        yield
    except UserError as e:
        if not e.agreed:
            _mark(placement.rank)
        raise
    except RuntimeError:  # gloo and nccl (DistError is one) when a peer has gone
        who = _marked()
        if who is not None:
            raise UserError(f"stopped: rank {who} reported a mistake", every_rank=True) from None
        failed = _marked(FAILED_KEY)
        if failed is not None and failed != str(placement.rank):
            # Its traceback is the cause; this rank's ("Connection closed by peer") would follow it
            # and be the last thing on the screen.
            raise PeerFailed(f"stopped: rank {failed} failed (its error is above)") from None
        _mark(placement.rank, FAILED_KEY)
        raise
    except Exception:  # a bug, or an error with a line of its own: the others stop without a second one
        _mark(placement.rank, FAILED_KEY)
        raise


def host_max(values: List[int], group) -> Callable[[], List[int]]:
    """An asynchronous element-wise MAX all-reduce of a few ints on a gloo group; call the result to
    wait for it."""
    import torch.distributed as dist

    flags = torch.tensor(values, dtype=torch.int64)
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def wait() -> List[int]:
        work.wait()
        return flags.tolist()  # a CPU tensor: no device sync

    return wait


def _within(seconds: float, fn: Callable[[], T]) -> Optional[T]:
    """fn() on a thread of its own, or None if it fails or takes longer: a store whose host is lost
    without closing its sockets would hold the caller for the store's timeout (minutes), and a rank
    that is leaving must not wait on it."""
    import threading

    out: List[Optional[T]] = [None]

    def call() -> None:
        try:
            out[0] = fn()
        except Exception:  # no store to tell or ask (its host has gone): the caller goes on without it
            pass

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    return out[0]


def _store():
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store() if dist.is_initialized() else None


def _mark(rank: int, key: str = MISTAKE_KEY) -> None:
    # Under torchrun the store outlives the ranks: its agent hosts it.
    store = _store()
    if store is not None:
        _within(STORE_SECONDS, lambda: store.set(key, str(rank)))


def _marked(key: str = MISTAKE_KEY) -> Optional[str]:
    """The rank that marked a mistake (or a failure) in the run's store, or None (none did, or the store is
    unreachable)."""
    store = _store()
    if store is None:
        return None
    return _within(STORE_SECONDS, lambda: store.get(key).decode() if store.check([key]) else None)
