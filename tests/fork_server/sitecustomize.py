"""The client side of the test suite's fork server (tests/fork_server/server.py), run by every Python process the
tests start (conftest puts this folder first on PYTHONPATH). A process started as `python [-u] -m MODULE ARGS`,
MODULE one of SERVED, with LAUNCHER_TEST_FORK_SERVER naming the server's socket, does not import torch itself: it
hands its command line, environment, folder, standard streams and limits to the server, which forks a process
that has torch imported already and runs the module there. This process stays as that process's stand-in for
whoever started it: it passes on every signal it can catch, and ends as the forked process ends (its exit code,
or killed by the same signal). Any other process, or any failure to reach the server, starts as usual."""

import os
import sys

SERVED = ("launcher", "torch.distributed.run", "tests")


def _module(argv):
    """MODULE of `python [-u] -m MODULE ...`, or None for any other command line."""
    args = argv[1:]
    while args and args[0] == "-u":
        args = args[1:]
    if len(args) >= 2 and args[0] == "-m":
        name = args[1]
        if any(name == served or name.startswith(served + ".") for served in SERVED):
            return name, args[2:]
    return None


def _hand_over(path, module, args):
    import array
    import json
    import resource
    import signal
    import socket
    import struct

    catchable = [s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, catchable)  # held until they can be passed on
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return  # no server (it ended with its session): start as usual
    try:
        fds = []
        for fd in (0, 1, 2):
            try:
                os.fstat(fd)
                fds.append(fd)
            except OSError:  # a closed stream: the forked process gets /dev/null there
                fds.append(os.open(os.devnull, os.O_RDWR))
        request = {
            "module": module, "args": args, "argv0": sys.orig_argv[0], "env": dict(os.environ), "cwd": os.getcwd(),
            "umask": os.umask(0o22),
            "unbuffered": "-u" in sys.orig_argv[1:3] or bool(os.environ.get("PYTHONUNBUFFERED")),
            "ignored": [int(s) for s in catchable if signal.getsignal(s) == signal.SIG_IGN],
            "mask": [int(s) for s in mask],
            "limits": {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource)
                       if name.startswith("RLIMIT_")},
            "client": os.getpid(), "nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0)),
            "policy": os.sched_getscheduler(0),
        }
        os.umask(request["umask"])
        body = json.dumps(request).encode()
        conn.sendmsg([struct.pack("!I", len(body)) + body],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
        child = struct.unpack("!i", _exactly(conn, 4))[0]

        def pass_on(signum, frame):
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

        for s in catchable:
            if s not in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
                try:
                    signal.signal(s, pass_on)
                except (OSError, ValueError):
                    pass
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        status = struct.unpack("!i", _exactly(conn, 4))[0]
        _end_as(status)
    except BaseException:  # connected: the module must not run here as well
        import traceback

        traceback.print_exc()
        os._exit(70)


def _end_as(status):
    """End as the forked process ended: its exit code, or killed by its signal. Never returns (were it to, site
    would go on to run the module here a second time)."""
    import signal

    try:
        if os.WIFSIGNALED(status):
            signum = os.WTERMSIG(status)
            if signum != signal.SIGKILL:
                signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            os.kill(os.getpid(), signum)
            os.kill(os.getpid(), signal.SIGKILL)  # a signal whose default is not to end: end as killed
    finally:
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _exactly(conn, n):
    data = b""
    while len(data) < n:
        try:
            got = conn.recv(n - len(data))
        except InterruptedError:
            continue
        if not got:  # the server is gone: the forked process with it
            os._exit(70)
        data += got
    return data


_path = os.environ.get("LAUNCHER_TEST_FORK_SERVER")
_served = _module(getattr(sys, "orig_argv", [])) if _path else None
if _served:
    _hand_over(_path, *_served)  # returns only where no server answered: this process runs the module itself
