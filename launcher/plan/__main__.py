"""`python -m launcher.plan RECIPE [key=value ...] --devices N --memory 80GB [--json]`: the bytes one rank holds
at the peak of the recipe's training step under each layout on N devices, which fit, the largest micro-batch
that fits each, and the one to use. Nothing is allocated: the step runs on fake tensors (launcher/plan/fake.py).
Docs: docs/planning.md."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from typing import List, Optional

from launcher import collector
from launcher.errors import EXIT_USER, UserError
from launcher.report import mistake
from launcher.run.planning import PLANNED

USAGE = ("python -m launcher.plan RECIPE.yaml [key=value ...] [--devices N] [--memory 80GB] [--device cuda|cpu] "
         "[--json]")
MIB, GIB = 2**20, 2**30


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        mistake(UserError(f"{message} (usage: {USAGE})"))
        raise SystemExit(EXIT_USER)


def main(argv: Optional[List[str]] = None) -> int:
    parser = _Parser(prog="python -m launcher.plan", usage=USAGE, description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--devices", type=int, default=1, help="devices (ranks) to plan for (default 1)")
    parser.add_argument("--memory", help="one device's memory, e.g. 80GB, 24GiB: which layouts fit, and the "
                                         "largest micro-batch of each")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="the device type trained on (when the loop frees gradients; default cuda)")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout, one per line")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="devices of one node: tensor parallel and a "
                                                                  "hsdp shard group stay within one (default 8)")
    parser.add_argument("--slurm", action="store_true", help="print the sbatch job of the layout to use (python -m "
                                                               "launcher.slurm render), on --devices over nodes")
    parser.add_argument("--jobs", type=int, help="layouts planned at once, each in a process of its own (default: "
                                                 "the CPUs; 1 plans them one after another in this process)")
    parser.add_argument("--as-run", metavar="STRATEGY", choices=PLANNED,
                        help="only the layout a run of this strategy on --devices ranks has (what a run prints)")
    parser.add_argument("--ep-capacity", type=float, default=1.0, metavar="F",
                        help="under parallel.ep: plan for each rank's experts receiving F times an even share of "
                             "the routed tokens (default 1: spread evenly; ep: all of the ep group's on one rank)")
    parser.add_argument("--length", type=int, metavar="L",
                        help="with --as-run: plan micro-batches padded to L (the batch a run measured; default: "
                             "its longest of the data's first items, the worst case)")
    parser.add_argument("--out", metavar="FILE", help="also write the --json lines to FILE, whole or not at all (a "
                                                      "mistake: {\"problem\": ...}): a run reads its plan there, "
                                                      "whatever the recipe's code prints")
    return _plan(parser.parse_intermixed_args(argv))


def _plan(args) -> int:
    """The plan the arguments ask for, said; the exit code."""
    try:
        if args.gpus_per_node < 1 or (args.slurm and args.devices % min(args.gpus_per_node, args.devices)):
            raise UserError(f"--gpus-per-node {args.gpus_per_node}: give a number of 1 or more that divides "
                            f"--devices {args.devices}")
        if args.slurm and args.memory is None:
            raise UserError("--slurm renders the job of the layout that fits: give --memory too")
        if args.devices < 1:
            raise UserError(f"--devices {args.devices}: give a number of devices of 1 or more")
        from launcher.plan import layouts, planner
        from launcher.plan.layouts import Layout
        from launcher.recipe import load

        memory = planner.size(args.memory, "--memory") if args.memory else None
        loaded = load(args.recipe, args.overrides)

        recipe = loaded.recipe
        if recipe.parallel.pp > 1:  # (a run under parallel.pp starts no planner beside it)
            if args.as_run:
                raise UserError(f"parallel.pp={recipe.parallel.pp}: the planner does not plan pipeline stages; plan "
                                f"without --as-run for the layouts it does plan")
            print(f"parallel.pp={recipe.parallel.pp}: pipeline stages are not planned; the layouts below have none",
                  file=sys.stderr)
        if recipe.parallel.cp > 1:  # (a run under parallel.cp starts no planner beside it)
            if args.as_run:
                raise UserError(f"parallel.cp={recipe.parallel.cp}: the planner does not plan context parallelism yet; "
                                f"plan without --as-run for the layouts it does plan")
            print(f"parallel.cp={recipe.parallel.cp}: context parallelism is not planned yet; the layouts below have "
                  f"none", file=sys.stderr)
        if args.as_run:
            p = recipe.parallel
            found = [Layout(args.as_run, args.devices, p.tp, p.dp_replicate, ep=p.ep) if args.as_run == "fsdp"
                     else Layout(args.as_run, args.devices)]
        else:
            found = layouts.candidates(args.devices, min(args.gpus_per_node, args.devices), recipe.parallel.ep)
        if args.jobs is not None and args.jobs < 1:
            raise UserError(f"--jobs {args.jobs}: give 1 or more")
        if not (args.ep_capacity >= 1 or args.as_run and args.ep_capacity > 0):  # (NaN too; a run's rank may
            # receive less than an even share, and plans what it measured)
            raise UserError(f"--ep-capacity {args.ep_capacity:g}: give 1 (the routed tokens spread evenly over the "
                            f"ep ranks, the default) or more, up to ep (all of an ep group's on one rank)")
        found = [dataclasses.replace(f, capacity=args.ep_capacity) if f.ep > 1 else f for f in found]
        if args.length is not None and not (args.as_run and args.length >= 1):
            raise UserError(f"--length {args.length}: give a length of 1 or more, with --as-run (a run's batch)")
        collector.resume()  # (paused while python -m launcher.plan started)
        rows = planner.plan(recipe, found, memory, args.device, largest=not args.as_run, jobs=args.jobs,
                            batches=planner.Batches(recipe, args.length))
        if args.out:
            _write(args.out, "\n".join(json.dumps(row.as_json()) for row in rows))
    except UserError as e:
        mistake(e)
        if args.out:
            with contextlib.suppress(UserError):  # (said already, where the mistake is --out's own)
                _write(args.out, json.dumps({"problem": e.problems[0]}))
        return EXIT_USER
    best = planner.chosen(rows)
    if args.slurm:
        return _slurm(args, best)
    if args.json:
        for row in rows:
            print(json.dumps(row.as_json()))
        return 0
    print(table(rows, memory))
    for said in dict.fromkeys(r.layout.assumes() for r in rows if r.peak is not None and r.layout.assumes()):
        print(f"ep: {said}")
    if all(r.peak is None for r in rows):
        print(_none_planned(rows, recipe.data.batch_size, args.devices))
    elif memory is not None:
        if best is None:
            print(f"none fits in {_size(memory)} per device: lower data.batch_size, or plan for more devices")
        else:
            keys = best.layout.overrides()
            if recipe.parallel.ep > 1 and best.layout.ep == 1:  # (the recipe's ep under a layout without it)
                keys.append("parallel.ep=1")
            line = " ".join(keys)
            print(f"use: {best.layout.name} (the least communication that fits)")
            print(f"  python -m launcher {args.recipe} {' '.join(args.overrides + [line])}".rstrip())
    return 0


def _write(path: str, text: str) -> None:
    """`text` in `path`, whole or not at all (the checkpoints' writer of small files: a temporary name, renamed);
    a path it cannot write is one line."""
    from pathlib import Path

    from launcher.checkpoint.files import write_text

    try:
        write_text(Path(path), text + "\n")
    except OSError as e:
        raise UserError(f"--out {path}: cannot be written ({e.strerror or e}); name a file in a writable folder") \
            from None


def _none_planned(rows, batch_size: int, devices: int) -> str:
    if all(r.micro_batch is None for r in rows):  # the batch divides under no layout
        return (f"none planned: data.batch_size {batch_size} does not divide among the data-parallel ranks of any "
                f"layout on {devices} devices; plan for a number of devices that divides it, or give "
                f"data.batch_size a multiple of {devices}")
    return "none planned: each layout's row says why"


def _slurm(args, best) -> int:
    """The layout to use as an sbatch job: python -m launcher.slurm render with its keys (the processes per node
    are Slurm's --gpus-per-node)."""
    import subprocess

    if best is None:
        mistake(UserError(f"--slurm: no layout fits in {args.memory} per device on {args.devices} devices; plan "
                          f"without --slurm to see each one's peak"))
        return EXIT_USER
    per_node = min(args.gpus_per_node, args.devices)
    keys = [k for k in best.layout.overrides() if not k.startswith("nproc_per_node=")]
    print(f"# python -m launcher.plan: {best.layout.name} fits in {args.memory} per device", file=sys.stderr)
    return subprocess.run([sys.executable, "-m", "launcher.slurm", "render", args.recipe, "--nodes",
                           str(args.devices // per_node), "--gpus-per-node", str(per_node), *args.overrides,
                           *keys]).returncode


def table(rows, memory: Optional[int]) -> str:
    from launcher.plan.fake import KINDS

    head = ["layout", "micro-batch", *KINDS, "peak per rank"] + (["fits", "largest micro-batch"] if memory else [])
    lines = [head]
    for r in rows:
        if r.peak is None:
            lines.append([r.layout.name, "-", f"cannot: {r.problem}"])
            continue
        cells = [r.layout.name, str(r.micro_batch), *(_size(r.peak.by_kind[k]) for k in KINDS), _size(r.peak.total)]
        if memory:
            cells += ["yes" if r.fits else "no", str(r.largest)]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines if len(line) > i and len(line) == len(head)) for i in range(len(head))]
    out = []
    for line in lines:
        if len(line) != len(head):
            out.append(f"{line[0]:<{widths[0]}}  {line[2]}")
        else:
            out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))))
    return "\n".join(out)


def _size(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 2**10:.1f} KiB"


if __name__ == "__main__":
    collector.pause()  # while torch and the recipe's libraries import; resumed before the step is planned
    sys.exit(main())
