"""The replica groups of a run on this machine: each one `python -m launcher` of the recipe (which starts
torchrun itself for a group of several processes, with its own free port), each in its own run folder
(`<run_dir>/group_<g>`) and its own session, its lines prefixed `[group g]`, and one exit code for the run.

The run's exit code: 0 when a group finished training (the others' failures are said, one line each: the live
groups trained on without them), 2 when a group met a user mistake, 128+N when this process got signal N (passed
on to every group, which saves and stops), else the code of the lowest group that failed
(128+N where signal N killed it).
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

from launcher.errors import EXIT_USER
from launcher.stopping import PARENT

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


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
        self.say = say
        self.processes: Dict[int, subprocess.Popen] = {}
        self.copying: List[threading.Thread] = []
        self.signum = 0

    def start(self, group: int, command: List[str], env: Dict[str, str]) -> None:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   bufsize=1, start_new_session=True)  # its own session: a signal reaches it from here
        self.processes[group] = process
        for source, sink in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
            copying = threading.Thread(target=_copy, args=(source, sink, f"[group {group}] "), daemon=True)
            copying.start()
            self.copying.append(copying)
        self.say(f"group {group}: started (process {process.pid}), run folder {command[-1].split('=', 1)[1]}")

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
        if code == 0 or (self.signum and code in (128 + self.signum, -self.signum)):
            return  # done, or stopped by the signal passed on (each group said where it saved)
        how = f"killed by {_signal_name(code)}" if code < 0 else f"exited with {code}"
        going = alive and not self.signum
        self.say(f"group {group}: {how}" + (f"; {alive} group{'s train' if alive > 1 else ' trains'} on" if going else ""))

    def _pass_on(self, signum: int, frame: object) -> None:
        self.signum = signum
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signum)

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


def _copy(source: TextIO, sink: TextIO, prefix: str) -> None:
    for line in source:
        sink.write(prefix + line)
        sink.flush()


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
