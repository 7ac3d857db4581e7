"""A run folder's lock (`<run_dir>/.lock`): a POSIX record lock that one run holds for its whole life, and
that others (a second run on the folder, a sweep's table) can test. Free of torch: `python -m launcher.sweep
report` reads it."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from launcher.errors import UserError, shown


def take(folder: Path, key: str = "run_dir") -> int:
    """The lock's descriptor, held until it is closed or the process ends, however it ends (on a file system
    without locks, some network mounts, the run goes unguarded). OSError when the folder cannot be written;
    UserError, naming the recipe's `key` (run_dir, checkpoint.dir), when another run holds it."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # Held by this process alone: a forked DataLoader worker does not inherit it, as it would an flock.
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        # the file's text, which anyone may have written: shown escaped (no line of its own, no terminal escape)
        holder = shown(os.pread(fd, 200, 0).decode(errors="replace").strip(), 120) or "another process"
        os.close(fd)
        own = "name=... or run_dir=..." if key == "run_dir" else f"{key}=..."
        raise UserError(f"{key}: {folder} is in use by another run ({holder}); wait for it to end, or give "
                        f"this one its own folder ({own})") from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    return fd


def held(folder: Path) -> bool:
    """Whether another process holds the folder's lock now (a POSIX record lock is the process's own, so
    this process's own lock does not count)."""
    try:
        fd = os.open(folder / ".lock", os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EACCES, errno.EAGAIN)
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
