"""How a rank's DataLoaders fetch and end: the recipe's loader options (worker processes, kept between
epochs or not, how far ahead, page-locked or not), and stopping a loader's workers when the run ends
rather than when the garbage collector finds the loader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.utils.data import DataLoader


@dataclass(frozen=True)
class Loading:
    """How a rank's loaders fetch: worker processes, and what torch's DataLoader does with them (the recipe's
    data.num_workers, persistent_workers, prefetch_factor, pin_memory)."""

    workers: int = 0
    persistent: bool = True  # workers kept between epochs and evaluations, not started again for each
    prefetch: Optional[int] = None  # batches each worker makes ahead; None: torch's (2)
    pin_memory: Optional[bool] = None  # None: where the batches go to a GPU

    def options(self, device: torch.device) -> dict:
        """DataLoader's keyword arguments."""
        out = {"num_workers": self.workers,
               "pin_memory": device.type == "cuda" if self.pin_memory is None else self.pin_memory}
        if self.workers:
            out["persistent_workers"] = self.persistent
            if self.prefetch is not None:
                out["prefetch_factor"] = self.prefetch
        return out


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
