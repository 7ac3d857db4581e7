"""How a rank's DataLoaders fetch, start and end: the recipe's loader options (worker processes, kept
between epochs or not, how far ahead, page-locked or not), where workers are started from, and stopping
a loader's workers when the run ends rather than when the garbage collector finds the loader.

Workers are forked from the rank, as torch does on Linux, except in a process group on CPython before
3.12. There gloo's and NCCL's threads make a Python thread state whenever they free a collective's
tensors, and a fork at that instant leaves the worker hung for good before it runs a line
(CPython gh-112275: the child takes the interpreter's list lock before making it anew; seen here
on 3.11.7, one resumed DDP run in a few). Workers are then forked from a fork server instead, a
process of one thread started once per rank (about 1.5 s, torch imported there): the dataset and the
collate function must pickle, as they must on macOS and Windows.
"""

from __future__ import annotations

import functools
import gc
import pickle
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.utils.data import DataLoader

from launcher.errors import UserError, first_line

FORK_SAFE = sys.version_info >= (3, 12)  # a fork beside threads that make thread states cannot hang the child


@dataclass(frozen=True)
class Loading:
    """How a rank's loaders fetch: worker processes, and what torch's DataLoader does with them (the recipe's
    data.num_workers, persistent_workers, prefetch_factor, pin_memory, multiprocessing_context)."""

    workers: int = 0
    persistent: bool = True  # workers kept between epochs and evaluations, not started again for each
    prefetch: Optional[int] = None  # batches each worker makes ahead; None: torch's (2)
    pin_memory: Optional[bool] = None  # None: where the batches go to a GPU
    start: Optional[str] = None  # how workers start (fork, forkserver, spawn); None: chosen below

    def options(self, device: torch.device) -> dict:
        """DataLoader's keyword arguments (and Loader's `named`: whether the recipe chose how workers start)."""
        out = {"num_workers": self.workers,
               "pin_memory": device.type == "cuda" if self.pin_memory is None else self.pin_memory}
        if self.workers:
            out["persistent_workers"] = self.persistent
            if self.prefetch is not None:
                out["prefetch_factor"] = self.prefetch
            if self.start is not None:
                out["multiprocessing_context"], out["named"] = _context(self.start), True
            else:
                out.update(_start())
        return out


def _start() -> dict:
    """Where workers are started from: forked from this process, or from a fork server (see above)."""
    import torch.distributed as dist

    if FORK_SAFE or not (dist.is_available() and dist.is_initialized()):
        return {}
    return {"multiprocessing_context": fork_server()}


def _context(method: str):
    import multiprocessing

    return fork_server() if method == "forkserver" else multiprocessing.get_context(method)


@functools.lru_cache(maxsize=1)
def fork_server():
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    # imported once in the server, so each worker is a fork that has them
    context.set_forkserver_preload(["torch", "launcher.data.sampling", "launcher.data.stream"])
    forkserver.ensure_running()  # started now, it imports them while the rank builds the rest of the run
    return context


class Loader(DataLoader):
    """torch's DataLoader, which says in one line, naming the recipe key, when its workers cannot be started
    because what they need does not pickle (started otherwise than by a fork)."""

    def __init__(self, *args, key: str, named: bool = False, **kwargs):
        self.key, self.named = key, named
        super().__init__(*args, **kwargs)

    def _get_iterator(self):
        try:
            with warnings.catch_warnings():  # torch's warning says less than the line below
                warnings.filterwarnings("ignore", message="Got pickle error when attempting to start a worker")
                return super()._get_iterator()
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            if self.multiprocessing_context is None or "pickle" not in str(e).lower():
                raise
            reason = first_line(e)
        gc.collect()  # the half-made iterator's queues let go of their semaphores (else a warning at exit)
        method = self.multiprocessing_context.get_start_method()
        if self.named:
            why, instead = f"start by {method} (data.multiprocessing_context)", "or set data.multiprocessing_context=fork"
        else:
            why = (f"start from a fork server here (torch.distributed on Python {sys.version_info.major}."
                   f"{sys.version_info.minor}, where a fork beside gloo's or NCCL's threads can hang)")
            instead = ("or set data.num_workers=0, or data.multiprocessing_context=fork (which can hang here), or use "
                       "Python 3.12 or newer")
        raise UserError(f"{self.key}: its loader workers {why}, so the dataset and collate function must pickle, and "
                        f"they do not: {reason}; make them picklable, {instead}")


def loading(value: Union[int, Loading]) -> Loading:
    return value if isinstance(value, Loading) else Loading(workers=value)


def shut(loader: DataLoader) -> None:
    """Stop a loader's worker processes now (persistent workers wait between epochs). Left to the garbage
    collector, a loader in a reference cycle has its queues closed before its workers are told to stop,
    and each worker is then waited for 5 s before it is killed (10 s at the end of a DDP run)."""
    iterator, loader._iterator = getattr(loader, "_iterator", None), None
    stop_workers(iterator)


def stop_workers(iterator: Any) -> None:
    """End a DataLoader iterator's worker processes (none where it has none)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
