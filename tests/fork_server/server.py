"""The test suite's fork server: one process that imports torch once and forks a process for each command a test
starts, so that the suite's ~550 processes do not each spend ~4 CPU s importing torch and torch._dynamo (which
every optimizer's step imports). Started by tests/conftest.py, one per pytest worker:

    python tests/fork_server/server.py SOCKET

The other side is tests/fork_server/sitecustomize.py, in every process a test starts: a `python [-u] -m
launcher ...` (or torchrun, or tests.hostile) hands its command line here and waits. The forked process takes that
process's standard streams, environment, folder, umask, limits, signal dispositions and mask, and runs the module as
`python -m` would, with sys.path built as that process's would be. It is a real process of its own (its own pid,
gloo, signals): what differs from a fresh one is only that torch, numpy and omegaconf are imported already, at
this server's environment (torch's import-time settings: OMP_NUM_THREADS, TORCHINDUCTOR_CACHE_DIR are the
session's). Nothing that reads its environment at import (transformers, huggingface_hub, datasets) is imported
here. os.getppid() in the forked process answers the stand-in's parent, so a worker still sees its launcher go.
Tests that need a process tree as a user's is (a rank stopped with SIGSTOP, workers found as children of a pid)
use the `own_processes` fixture, and their processes start as usual."""

import importlib
import io
import json
import os
import select
import signal
import socket
import struct
import sys

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.elastic.agent.server.api", "torch.distributed.checkpoint",
           "numpy", "omegaconf", "yaml")


def serve(path: str) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for name in PRELOAD:
        importlib.import_module(name)
    # what a fresh interpreter's sys.path holds beyond its first entry and PYTHONPATH: the standard library, site
    base = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_w, False)
    signal.set_wakeup_fd(woken_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    serving = {}  # the stand-in's connection -> the forked process's pid
    print("ready", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:  # pytest's process gone (killed): so is this one
        ready = select.select([listener, woken_r, *serving], [], [], 2.0)[0]
        if woken_r in ready:
            os.read(woken_r, 512)
            _reap(serving)
        for conn in [c for c in ready if c in serving]:
            try:
                gone = not conn.recv(1)
            except OSError:
                gone = True
            if gone:  # the stand-in died (SIGKILL, which it could not pass on): so does its process
                try:
                    os.kill(serving[conn], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request, fds = _request(conn)
            except (OSError, ValueError):  # the stand-in died while it asked: nothing to run
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                os.close(woken_r)
                os.close(woken_w)
                for other in serving:
                    other.close()
                conn.close()
                _run(request, fds, base, here)  # never returns
            for fd in fds:
                os.close(fd)
            serving[conn] = pid
            try:
                conn.sendall(struct.pack("!i", pid))
            except OSError:  # the stand-in died while its process was made: so does the process (as above)
                os.kill(pid, signal.SIGKILL)


def _reap(serving: dict) -> None:
    by_pid = {pid: conn for conn, pid in serving.items()}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = by_pid.get(pid)
        if conn is not None:
            try:
                conn.sendall(struct.pack("!i", status))
            except OSError:
                pass
            conn.close()
            del serving[conn]


def _request(conn: socket.socket):
    import array

    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    size = struct.unpack("!I", data[:4])[0]
    body = data[4:]
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), list(fds)


def _run(request: dict, fds: list, base: list, here: str) -> None:
    """In the forked process: become the stand-in's process, run the module as `python -m` does, and end."""
    import resource
    import runpy
    import threading

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, (soft, hard) in request["limits"].items():
            try:
                resource.setrlimit(getattr(resource, name), (soft, hard))
            except (ValueError, OSError):
                pass
        for s in signal.Signals:
            if s in (signal.SIGKILL, signal.SIGSTOP):
                continue
            signal.signal(s, signal.SIG_IGN if int(s) in request["ignored"] else
                          signal.default_int_handler if s == signal.SIGINT else
                          signal.SIG_IGN if s in (signal.SIGPIPE, signal.SIGXFSZ) else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [signal.Signals(s) for s in request["mask"]])
        unbuffered = request["unbuffered"]
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.open(0, "rb", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = _writer(1, unbuffered, "strict")
        sys.stderr = sys.__stderr__ = _writer(2, unbuffered, "backslashreplace", line=True)
        pythonpath = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *[os.path.abspath(p) for p in pythonpath], *base]
        sys.argv[:] = [request["argv0"], *request["args"]]
        os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
        os.sched_setaffinity(0, request["cpus"])
        if request["policy"] == os.SCHED_IDLE:  # (the memory planner's, beside a run)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        _stand_in(request["client"])
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            _flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        _flush()
        os._exit(code)


def _writer(fd: int, unbuffered: bool, errors: str, line: bool = False) -> io.TextIOWrapper:
    raw = io.open(fd, "wb", buffering=0, closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, write_through=unbuffered,
                            line_buffering=line or os.isatty(fd))


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _stand_in(client: int) -> None:
    """os.getppid() answers the stand-in's parent, so that a worker sees the process that started it go; os.getpid()
    stays this process's own (a lock's pid is this process's, the stand-in's Popen.pid another: tests that compare
    them use `own_processes`)."""
    me = os.getpid()
    os.getppid = lambda: _parent_of(client) if os.getpid() == me else _real_ppid()


_real_ppid = os.getppid


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 1  # the stand-in is gone


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


if __name__ == "__main__":
    serve(sys.argv[1])
