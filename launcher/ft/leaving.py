"""A group that loses one of its processes leaves the run at once.

Only rank 0 of a group heartbeats to the lighthouse (torchft's ManagerServer lives in its process). When another
rank of the group dies, torchrun's agent SIGTERMs the rest; but a survivor blocked in a torchft call (a quorum
or a commit that waits for the dead rank's vote) or in a collective runs no Python signal handler until the
call returns, which takes up to timeouts.join, and its server heartbeats all that time. The lighthouse then
counts the group as live and, with two groups, refuses the live one any quorum (torchft asks more than half of
the live-looking groups), which stops the run (exit 6).

So each process of a group of several listens for the signals the stop flag handles on a wakeup fd, which the
interpreter writes from its C-level handler however the main thread is blocked, and a thread reads it. On a
signal it looks at its group's processes on this machine: one of them gone (exited, or a zombie) means the group
can neither commit nor save a step (its peers' shards and votes are lost), so this process ends now, and with it
its heartbeat: the lighthouse drops the group after timeouts.pg, as it drops a group killed whole. With every
process alive the signal is a stop asked of the group (python -m launcher.ft passing one on, Slurm): nothing is
done here, and the group saves at its next step boundary.

Peers on other machines are not looked at: a group whose processes span machines still waits for torchft's
timeouts when one of them is lost there (docs/fault-tolerance.md).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import List, Optional, Sequence, Tuple

from launcher.stopping import SIGNALS


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped by torchrun, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: the pid was reused, so ours is gone
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc: kill(0) said it is there


def gone(peers: Sequence[Tuple[str, int]], rank: int, host: Optional[str] = None) -> List[Tuple[int, int]]:
    """(rank, pid) of each process of the group on this machine that no longer runs; `peers` is every rank's
    (host, pid), in rank order."""
    host = host or socket.gethostname()
    return [(r, pid) for r, (where, pid) in enumerate(peers) if r != rank and where == host and not alive(pid)]


class Watch:
    """The thread that ends this process when a signal comes after a peer of its group has died."""

    def __init__(self, peers: Sequence[Tuple[str, int]], rank: int, group: int):
        self.peers, self.rank, self.group = list(peers), rank, group
        self.reading, writing = socket.socketpair()
        writing.setblocking(False)  # the C handler must never block on it
        self.writing = writing
        self.previous = signal.set_wakeup_fd(writing.fileno(), warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._run, name="launcher-ft-leaving", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        watched = {int(s) for s in SIGNALS}
        while True:
            try:
                got = self.reading.recv(64)
            except OSError:
                return
            if not got:
                return  # closed
            if watched.intersection(got):
                self._check(next(b for b in got if b in watched))

    def _check(self, signum: int) -> None:
        lost = gone(self.peers, self.rank)
        if not lost:
            return
        who = ", ".join(f"rank {r} (process {pid})" for r, pid in lost)
        line = (f"launcher: fault tolerance: rank {self.rank} of group {self.group}: {who} of this group is gone; the "
                f"group leaves the run now, unsaved (the live groups train on without it; started again, it copies "
                f"their state)\n")
        try:
            os.write(2, line.encode())
        finally:
            os._exit(128 + signum)  # now: its heartbeat (rank 0's) ends with it; no step of it can be committed

    def close(self) -> None:
        """Stop listening (the run is over): the previous wakeup fd back."""
        try:
            signal.set_wakeup_fd(self.previous)
        except ValueError:  # not the main thread
            pass
        self.writing.close()
        self.reading.close()


def watch(peers: Sequence[Tuple[str, int]], rank: int, group: int) -> Optional[Watch]:
    """A Watch, for a group of several processes (from the main thread, which alone may set a wakeup fd)."""
    if len(peers) < 2 or threading.current_thread() is not threading.main_thread():
        return None
    return Watch(peers, rank, group)
