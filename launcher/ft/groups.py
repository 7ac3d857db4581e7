"""The replica groups of a run on this machine: each one `python -m launcher` of the recipe (which starts
torchrun itself for a group of several processes, with its own free port), each in its own run folder
(`<run_dir>/group_<g>`) and its own session, its lines prefixed `[group g]`, and one exit code for the run.

Each group writes its lines itself into its run folder (`stdout.log`, `stderr.log`, appended to), and this
process follows those files onto its console: a group's lines are kept, and it never blocks nor fails on a write,
whatever becomes of this process or of its terminal.

The run's exit code: 0 when a group finished training (the others' failures are said, one line each: the live
groups trained on without them), 2 when a group met a user mistake, 128+N when this process got signal N (passed
on to every group, which saves and stops; SIGHUP, a terminal closed, passed on as SIGTERM), else the code of the
lowest group that failed (128+N where signal N killed it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, TextIO

from launcher.errors import EXIT_USER, UserError
from launcher.stopping import PARENT

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
AS = {signal.SIGHUP: signal.SIGTERM}  # what a group is sent for a signal it does not stop on itself
OUTPUTS = ("stdout.log", "stderr.log")  # in each group's run folder
POLL = 0.05  # seconds between two reads of a group's output files at their end
# One writer at a time on this process's console: a TextIOWrapper written by several threads at once loses text
# (a group's line gone from the console while its file has it)
CONSOLE = threading.Lock()


def folder(run_dir: str, group: int) -> str:
    return str(Path(run_dir) / f"group_{group}")


def command(recipe: Path, overrides: List[str], group: int, run_dir: str) -> List[str]:
    """Group `group`'s command: the recipe and the command line's keys, then its index and its own run folder."""
    return [sys.executable, "-m", "launcher", str(recipe), *overrides, f"fault_tolerance.group={group}",
            f"run_dir={folder(run_dir, group)}"]


def environment(base: Dict[str, str], group: int, lighthouse: str, threads: int) -> Dict[str, str]:
    """What each group is started with: torchft's two variables, unbuffered output (its lines come as they are
    said), this process's pid, and the CPU threads of its share of this machine unless OMP_NUM_THREADS says
    otherwise."""
    env = {**base, "REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": lighthouse, "PYTHONUNBUFFERED": "1",
           PARENT: str(os.getpid())}  # a group stops (saving) when this process, and the lighthouse in it, is gone
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


class Groups:
    """Started processes, one per group, with the threads that copy their lines here."""

    def __init__(self, say: Callable[[str], None]):
        self.say = lambda line: _locked(say, line)
        self.processes: Dict[int, subprocess.Popen] = {}
        self.copying: List[threading.Thread] = []
        self.signum = 0

    def start(self, group: int, command: List[str], env: Dict[str, str]) -> None:
        run_dir = Path(command[-1].split("=", 1)[1])
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            files = [open(run_dir / name, "ab") for name in OUTPUTS]  # (a group started again appends to them)
        except OSError as e:
            raise UserError(f"run_dir: {run_dir} cannot hold group {group}'s output ({e.strerror or e}); name a "
                            f"folder this user may write") from None
        starts = [f.seek(0, os.SEEK_END) for f in files]
        try:
            process = subprocess.Popen(command, env=env, stdout=files[0], stderr=files[1],
                                       start_new_session=True)  # its own session: a signal reaches it from here
        finally:
            for f in files:
                f.close()  # the group holds them now
        self.processes[group] = process
        for name, start, sink in zip(OUTPUTS, starts, (sys.stdout, sys.stderr)):
            copying = threading.Thread(target=_follow, args=(run_dir / name, start, process, sink,
                                                             f"[group {group}] "), daemon=True)
            copying.start()
            self.copying.append(copying)
        self.say(f"group {group}: started (process {process.pid}), run folder {run_dir}")

    def wait(self) -> int:
        """Wait for every group (passing this process's signals on to them), saying each one's end as it comes;
        the run's exit code."""
        previous = {sig: signal.signal(sig, self._pass_on) for sig in FORWARDED}
        codes: Dict[int, int] = {}
        try:
            while len(codes) < len(self.processes):
                for group, process in sorted(self.processes.items()):
                    if group not in codes and process.poll() is not None:
                        codes[group] = process.returncode
                        self._ended(group, process.returncode, alive=len(self.processes) - len(codes))
                time.sleep(0.1)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for copying in self.copying:
            copying.join(timeout=5)
        return self._outcome(dict(sorted(codes.items())))

    def _ended(self, group: int, code: int, alive: int) -> None:
        sent = AS.get(self.signum, self.signum)
        if code == 0 or (self.signum and code in (128 + sent, -sent)):
            return  # done, or stopped by the signal passed on (each group said where it saved)
        how = f"killed by {_signal_name(code)}" if code < 0 else f"exited with {code}"
        going = alive and not self.signum
        self.say(f"group {group}: {how}" + (f"; {alive} group{'s train' if alive > 1 else ' trains'} on" if going else ""))

    def _pass_on(self, signum: int, frame: object) -> None:
        self.signum = signum
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(AS.get(signum, signum))

    def _outcome(self, codes: Dict[int, int]) -> int:
        failed = {g: c for g, c in codes.items() if c != 0}
        if self.signum:
            return 128 + self.signum
        if EXIT_USER in failed.values():
            return EXIT_USER
        if len(failed) < len(codes):
            if failed:
                finished = ", ".join(str(g) for g in codes if g not in failed)
                self.say(f"the run finished: group{'s' * (len(codes) - len(failed) > 1)} {finished} trained to the end "
                         f"(each group's run folder holds its model.pt)")
            return 0
        lowest = failed[min(failed)]
        return lowest if lowest > 0 else 128 - lowest  # killed by signal N: 128+N, as a shell says it


def _follow(path: Path, start: int, process: subprocess.Popen, sink: TextIO, prefix: str) -> None:
    """Copy each line the group writes into `path` (from offset `start`) onto `sink`, prefixed, until the group
    has ended and every line is copied. A console that fails (a terminal closed) is given up; the file has it."""
    with open(path, "rb") as source:
        source.seek(start)
        pending = b""
        while True:
            ended = process.poll() is not None  # before the read: what it wrote before it ended is read next
            got = source.read()
            pending += got
            *lines, pending = pending.split(b"\n")
            for line in lines:
                sink = _write(sink, prefix + line.decode(errors="replace") + "\n")
            if ended and not got:
                if pending:
                    _write(sink, prefix + pending.decode(errors="replace") + "\n")
                return
            if not got:
                time.sleep(POLL)


def _write(sink: Optional[TextIO], text: str) -> Optional[TextIO]:
    if sink is None:
        return None
    try:
        with CONSOLE:
            sink.write(text)
            sink.flush()
        return sink
    except (OSError, ValueError):
        return None


def _locked(say: Callable[[str], None], line: str) -> None:
    with CONSOLE:
        say(line)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def threads_each(groups: int, processes: int, cpus: int) -> int:
    """CPU threads per process so that every group's processes share this machine's cores."""
    return max(1, cpus // max(1, groups * processes))


def env_without(names: tuple, env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment without `names` (a group gets its own)."""
    return {k: v for k, v in (env if env is not None else os.environ).items() if k not in names}
