"""`python -m launcher.ft RECIPE [key=value ...]`: a fault-tolerant run on this machine.

Without fault_tolerance.group, it starts a lighthouse in this process (unless fault_tolerance.lighthouse or
TORCHFT_LIGHTHOUSE names one already running) and every group of fault_tolerance.groups, then waits for them:
a group that dies leaves the others training. With fault_tolerance.group=G, it starts that one group alone,
which joins the run at the lighthouse named and copies a live group's state: the way to start a lost group
again, here or on another machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from launcher.errors import EXIT_USER, UserError
from launcher.report import mistake

USAGE = "python -m launcher.ft RECIPE.yaml fault_tolerance.groups=N [key=value ...]"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.ft", usage=USAGE, description=__doc__.split("\n\n")[1],
                                     epilog="docs/fault-tolerance.md: what survives what, the timeouts, the run folders")
    parser.add_argument("recipe", help="the recipe file, e.g. recipes/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. fault_tolerance.groups=2")
    args = parser.parse_args(argv)
    try:
        return _run(args.recipe, args.overrides)
    except UserError as e:
        mistake(e)
        return EXIT_USER


def _run(path: str, overrides: List[str]) -> int:
    from launcher.ft import groups, settings
    from launcher.placement.spawn import cpus
    from launcher.recipe import load

    loaded = load(path, overrides)
    section = loaded.recipe.fault_tolerance
    if section is None:
        raise UserError(f"fault_tolerance: {path} has no fault_tolerance section, and python -m launcher.ft runs "
                        f"replica groups; add fault_tolerance.groups=N (or train with python -m launcher)")
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


def _say(line: str) -> None:
    print(f"launcher.ft: {line}", flush=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the lighthouse's threads are torchft's (Rust): the process ends without waiting on them
