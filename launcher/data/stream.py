"""Streams as data: a `torch.utils.data.IterableDataset` (HF `datasets` in streaming mode, WebDataset, a
generator over files) read without a sampler, each rank and each loader worker taking its own share
(launcher/data/share.py: which items, in which batches, and the place each batch leaves the stream at), and
resumed exactly.

Training (`StreamData`) reads its rank's share endlessly, epoch after epoch, and a checkpoint keeps the place
of its last batch; validation (`StreamBatches`) reads every item once at each evaluation. Either way one
DataLoader per pass hands out the batches its workers collate (`loader`), never started again between epochs.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from launcher.data.collate import default
from launcher.data.device import placed
from launcher.data.loaders import Loader, Loading, loading, stop_workers
from launcher.data.sampling import Padding
from launcher.data.share import PADDING, START, Share, is_hf_stream


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset) or is_hf_stream(dataset)


class _Workers(IterableDataset):
    """The DataLoader's dataset: in each worker, that worker's batches of the rank's share."""

    def __init__(self, share: Share, start: Dict[str, Any], collate: Callable):
        self.share, self.start, self.collate = share, start, collate

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.share.batches(self.start, worker, workers, self.collate)


def _as_is(x: Any) -> Any:
    return x


def loader(share: Share, start: Dict[str, Any], collate: Callable, num_workers: Union[int, Loading],
           device: torch.device) -> DataLoader:
    # A stream's loader is never started again between epochs (its stream has none); each evaluation's ends
    # with its stream
    options = {**loading(num_workers).options(device), "persistent_workers": False}
    return Loader(_Workers(share, start, collate), batch_size=None, collate_fn=_as_is, **options, key=share.key,
                      # its own generator: starting the iterator (a resume does) draws nothing from the global one
                      generator=torch.Generator().manual_seed(share.seed))


class StreamBatches:
    """Validation from a stream: the rank's share of every item, in batches of data.batch_size / W (the
    last one smaller), read again at each evaluation; as many batches on every rank, a rank short of the
    last one running a `Padding` batch instead (launcher/data/share.py: Share._last)."""

    def __init__(self, dataset: Any, batch_size: int, replicas: int, rank: int, num_workers: Union[int, Loading],
                 device: torch.device, collate: Optional[Callable], to_device: Callable, seed: int = 0):
        self.share = Share(dataset, "data.val", batch_size, replicas, rank, drop_last=False, seed=seed)
        self.collate, self.num_workers, self.device, self.to_device = collate or default, num_workers, device, to_device

    def __iter__(self):
        for place, batch in loader(self.share, START, self.collate, self.num_workers, self.device):
            batch = self.to_device(batch, self.device)
            yield Padding(batch) if place == PADDING else batch

    def close(self) -> None:
        pass  # each evaluation's loader ends with its stream


class StreamData:
    """The training data of one rank when data.train is a stream: TrainData's interface (launcher/data/sampling.py)
    with no epochs to count, and a place in the stream that checkpoints keep."""

    steps_per_epoch = None
    is_stream = True

    def __init__(self, dataset: Any, batch_size: int, replicas: int, rank: int, num_workers: Union[int, Loading],
                 device: torch.device, collate_fn: Optional[Callable] = None, seed: int = 0):
        self.share = Share(dataset, "data.train", batch_size, replicas, rank, seed=seed)
        self.collate = collate_fn or default
        self.num_workers, self.device = num_workers, device
        self.start: Dict[str, Any] = dict(START)
        self.last: Optional[Dict[str, Any]] = None
        self.batches: Optional[Iterator[tuple]] = None  # the loader's iterator: its workers stop on close()

    def first_items(self) -> List[Any]:
        return self.share.first_items()

    def host_batches(self, position) -> Iterator[tuple]:
        self.batches = iter(loader(self.share, self.start, self.collate, self.num_workers, self.device))
        return self.batches

    def close(self) -> None:
        if self.batches is not None:
            stop_workers(self.batches)

    def arrive(self, place: Dict[str, Any], position) -> None:
        position.epoch, position.batch = place["epoch"], place["batch"]
        self.last = place

    def state(self) -> Dict[str, Any]:
        """Where the stream stands after the last batch handed out (what a checkpoint keeps of this rank)."""
        return self.last if self.last is not None else self.start

    def restart_at(self, place: Dict[str, Any]) -> None:
        """Read on from `place`, a place of this rank's (a step dropped and trained again from its start)."""
        self.start, self.last = place, None

    def take(self, place: Dict[str, Any]) -> None:
        """Read on from where another rank of the same world stands (fault tolerance: a live group's)."""
        self.restart_at(self.share.joined_place(place))

    def resume(self, saved: List[Dict[str, Any]], world: int) -> Optional[str]:
        self.start, note = self.share.resume_place(saved, world)
        self.last = None
        return note

    def stream(self, position) -> Iterator[Any]:
        """Micro-batches on the device, endlessly; each moves `position` and this rank's place in the stream."""
        return placed(self, position)
