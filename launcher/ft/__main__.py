"""`python -m launcher.ft RECIPE [key=value ...]`: a fault-tolerant run on this machine.

Without fault_tolerance.group, it starts a lighthouse in this process (unless fault_tolerance.lighthouse or
TORCHFT_LIGHTHOUSE names one already running) and every group of fault_tolerance.groups, then waits for them:
a group that dies leaves the others training. With fault_tolerance.group=G, it starts that one group alone,
which joins the run at the lighthouse named and copies a live group's state: the way to start a lost group
again, here or on another machine. With --lighthouse, it starts the lighthouse alone and serves until stopped
(SIGTERM, Ctrl-C): the groups run elsewhere (Slurm jobs, Kubernetes pods), told its address.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import List, Optional

from launcher.errors import EXIT_USER, UserError, first_line
from launcher.report import mistake

USAGE = "python -m launcher.ft RECIPE.yaml fault_tolerance.groups=N [key=value ...]"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.ft", usage=USAGE, description=__doc__.split("\n\n")[1],
                                     epilog="docs/fault-tolerance.md: what survives what, the timeouts, the run folders")
    parser.add_argument("recipe", help="the recipe file, e.g. recipes/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. fault_tolerance.groups=2")
    parser.add_argument("--lighthouse", action="store_true",
                        help="start the lighthouse alone (the recipe's min_groups and timeouts) and serve until stopped")
    parser.add_argument("--bind", help="with --lighthouse: where it listens, e.g. [::]:29510 (default: a free port)")
    parser.add_argument("--address-file", metavar="PATH",
                        help="with --lighthouse: a file its http://host:port is written into once it serves")
    args = parser.parse_intermixed_args(argv)
    try:
        if args.lighthouse:
            return _serve(args.recipe, args.overrides, args.bind or "[::]:0", args.address_file)
        if args.bind or args.address_file:
            raise UserError(f"--{'bind' if args.bind else 'address-file'} is an option of --lighthouse, which starts "
                            f"the lighthouse alone; add --lighthouse, or leave it out")
        return _run(args.recipe, args.overrides)
    except UserError as e:
        mistake(e)
        return EXIT_USER


def _run(path: str, overrides: List[str]) -> int:
    from launcher.ft import groups, settings
    from launcher.placement.spawn import cpus
    from launcher.recipe import load

    loaded = load(path, overrides)
    section = _section(loaded, path)
    env = groups.env_without(("REPLICA_GROUP_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))
    lighthouse = server = None
    if section.group is not None:  # one group, joining a run whose lighthouse is named
        which = [section.group]
        lighthouse = settings.lighthouse_address(section, env)
    else:
        which = list(range(section.groups))
        if section.lighthouse or env.get(settings.LIGHTHOUSE_VARIABLE):
            lighthouse = settings.lighthouse_address(section, env)
        else:
            from launcher.ft import lighthouse as lighthouses

            server = lighthouses.start(section)
            lighthouse = server.address()
            _say(f"lighthouse at {lighthouse} (a quorum needs {section.min_groups} of {section.groups} groups)")
    processes = loaded.recipe.nproc_per_node or 1
    threads = groups.threads_each(len(which), processes, cpus())
    started = groups.Groups(_say)
    try:
        for group in which:
            started.start(group, groups.command(loaded.path, overrides, group, loaded.recipe.run_dir),
                          groups.environment(env, group, lighthouse, threads))
        return started.wait()
    finally:
        if server is not None:
            server.shutdown()


def _serve(path: str, overrides: List[str], bind: str, address_file: Optional[str]) -> int:
    """The lighthouse alone, until SIGTERM or SIGINT; its address said, and written into `address_file`."""
    from launcher.ft import lighthouse as lighthouses

    from launcher.recipe import load

    section = _section(load(path, overrides), path)
    if not re.fullmatch(r"(\[[0-9A-Fa-f:.]*\]|[^\s:\[\]]+):\d{1,5}", bind):
        raise UserError(f"--bind {bind}: not a host:port the lighthouse can listen on, e.g. [::]:29510 or 0.0.0.0:29510")
    try:
        server = lighthouses.start(section, bind)
    except Exception as e:  # torchft's: a port taken, an address not of this machine
        raise UserError(f"--bind {bind}: the lighthouse cannot listen there ({first_line(e)})") from None
    stop = threading.Event()  # (its handlers after torchft's start, which sets its own)
    previous = {sig: signal.signal(sig, lambda *args: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        address = server.address()
        if address_file:
            write_atomically(Path(address_file), address + "\n")
        _say(f"lighthouse at {address} (a quorum needs {section.min_groups} of {section.groups} groups); serving "
             f"until stopped (SIGTERM, Ctrl-C)")
        while not stop.wait(1):
            pass
        _say("lighthouse stopped")
        return 0
    finally:
        server.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _section(loaded, path: str):
    section = loaded.recipe.fault_tolerance
    if section is None:
        raise UserError(f"fault_tolerance: {path} has no fault_tolerance section, and python -m launcher.ft runs "
                        f"replica groups; add fault_tolerance.groups=N (or train with python -m launcher)")
    return section


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` whole or not at all: a reader polling for it never reads half of it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.tmp")
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as e:
        raise UserError(f"--address-file {path}: cannot be written ({e.strerror or e})") from None


def _say(line: str) -> None:
    try:
        print(f"launcher.ft: {line}", flush=True)
    except (OSError, ValueError):  # the console is gone (a terminal closed): the groups' lines are in their folders
        pass


if __name__ == "__main__":
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a console gone
            pass
    os._exit(code)  # the lighthouse's threads are torchft's (Rust): the process ends without waiting on them
