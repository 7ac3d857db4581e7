"""`python -m launcher recipe.yaml strategy=ddp` outside torchrun: start torchrun in this process.

This reuses torch.distributed.run (torchrun itself) rather than re-implementing it: the
workers are `python -m launcher` with the same recipe and overrides, on one node.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Tuple

from launcher.errors import EXIT_BUG, EXIT_USER, UserError


def process_count(nproc_per_node: Optional[int], visible_gpus: int, device: str, cpus: int, strategy: str = "ddp",
                  layout: Optional[Tuple[str, int]] = None) -> int:
    """How many workers to start for `strategy` (ddp, fsdp): one per visible GPU by default. More than the
    machine holds (a process per GPU, at least a core per process on the CPU) is refused: nproc_per_node=100 on
    two cores once started 100 workers and took 14 GB before the first step. `layout`: the recipe's parallel
    keys that lay ranks out (`parallel.ep=2`) and the count the processes must be a multiple of, for the line."""
    on_gpu = device != "cpu" and visible_gpus > 0
    if not nproc_per_node:
        if on_gpu:
            return visible_gpus
        keys, multiple = layout or ("", 1)
        n = str(multiple) if multiple > 1 else "N"
        count = f" or a multiple of {n} ({keys} lays ranks out in groups of {n})" if multiple > 1 else ""
        raise UserError(f"nproc_per_node: strategy={strategy} on the CPU starts torchrun for you and needs a process "
                        f"count; add nproc_per_node={n}{count}, or start it with torchrun --nproc_per_node={n} -m "
                        f"launcher ...")
    if on_gpu and nproc_per_node > visible_gpus:
        raise UserError(f"nproc_per_node: {nproc_per_node} processes, but this process sees {visible_gpus} GPU(s) "
                        f"and strategy={strategy} trains one process per GPU; use nproc_per_node={visible_gpus} or fewer")
    if not on_gpu and nproc_per_node > cpus:
        raise UserError(f"nproc_per_node: {nproc_per_node} processes on the CPU, but this process may use {cpus} "
                        f"CPU core(s) (os.sched_getaffinity); each process needs a core of its own: use "
                        f"nproc_per_node={cpus} or fewer")
    return nproc_per_node


def cpus() -> int:
    """The CPU cores this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def torchrun(recipe: Path, overrides: List[str], nproc: int) -> int:
    """Run the recipe under torchrun with `nproc` workers: 0, the exit code of the failed workers (2 if
    any made a user mistake), or 128+N when this process got signal N (torchrun passed it on, and the
    workers saved and stopped)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from launcher.stopping import PARENT, exit_code

    os.environ[PARENT] = str(os.getpid())  # the workers stop when this process is gone (launcher/stopping.py)
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "launcher", str(recipe), *overrides])
    try:
        run(args)
    except ChildFailedError as e:
        # The workers have said what went wrong; torchrun's own report would repeat it for each rank.
        # A user mistake on one rank makes the others fail in turn (or be stopped by torchrun): it is the
        # run's outcome, whichever rank torchrun saw fail first.
        if any(f.exitcode == EXIT_USER for f in e.failures.values()):
            return EXIT_USER
        _, first = e.get_first_failure()
        return first.exitcode if first.exitcode and first.exitcode > 0 else EXIT_BUG
    except Exception as e:
        # torchrun's handler raised SignalException; its agent passed the signal on to the workers and waited
        # for them to save and exit (its shutdown timeout, 30 s): the plain path's exit code, no traceback.
        # A signal that lands inside torch's metrics wrapper before its clock is read comes out as that
        # wrapper's UnboundLocalError, with the SignalException as its context (torch 2.13; seen in CI).
        signalled = signal_in(e, SignalException)
        if signalled is None:
            raise
        return exit_code(signalled.sigval)
    return 0


def signal_in(error: BaseException, kind: type) -> Optional[BaseException]:
    """The exception of `kind` that `error` is, or was raised while handling (or from)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
