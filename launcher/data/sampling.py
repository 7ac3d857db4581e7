"""The data path: the sample order (one permutation per (seed, epoch), each rank its share),
resumable in the middle of an epoch, and batches fetched whole where the dataset allows it; they reach
the device through launcher/data/device.py.

Batched fetching: a dataset with `__getitems__(indices)` is asked for a whole batch at once (as the
DataLoader does). If it returns a list, that is a list of items and is collated as usual; anything
else (a tuple or dict of batched tensors) is the batch itself, with no per-item Python. An in-memory
`TensorDataset` is fetched this way: one indexing per tensor instead of one per item.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from launcher.data import item_rng
from launcher.data.device import placed, to_device
from launcher.data.loaders import Loader, Loading, loading, shut
from launcher.data.collate import default
from launcher.errors import UserError, first_line


@dataclass
class Position:
    """Where training stands: optimizer steps taken, and the next micro-batch of which epoch."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


class EpochSampler(Sampler[int]):
    """DistributedSampler's order (seed + epoch, rank r takes every W-th index), trimmed to whole
    optimizer steps and started at a given batch, so a resumed epoch continues where it stopped.
    `keyed`: each index comes as (epoch, index), the key its item is seeded from (launcher/data/item_rng.py)."""

    def __init__(self, dataset: Dataset, replicas: int, rank: int, shuffle: bool, seed: int,
                 per_rank_batch: int, batches_per_epoch: int, keyed: bool = False):
        self.order = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle,
                                        seed=seed, drop_last=True)
        self.size = batches_per_epoch * per_rank_batch
        self.per_rank_batch = per_rank_batch
        self.start = 0
        self.keyed = keyed

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.order.set_epoch(epoch)
        self.start = start_batch * self.per_rank_batch

    def __iter__(self) -> Iterator[int]:
        indices = list(self.order)[self.start:self.size]
        if self.keyed:
            epoch = self.order.epoch
            return iter([(epoch, i) for i in indices])
        return iter(indices)

    def __len__(self) -> int:
        return self.size - self.start


class ShardSampler(Sampler[int]):
    """Validation: every item exactly once across ranks, rank r takes r, r+W, ... `keyed`: as (-1, index), the
    key its item is seeded from (an epoch of its own).

    Every rank runs as many batches as rank 0, which has the most items: a sharded model's forward is collective
    (fsdp's all-gathers, ep's all-to-alls), and a rank with a batch fewer left the others waiting in their last
    forward until dist_timeout. Ranks differ by one item at most, so a rank short of a batch has a whole number of
    batches and gets one more, of one item (item 0), `padded`: run, never counted (ValBatches, evaluate)."""

    def __init__(self, n: int, replicas: int, rank: int, keyed: bool = False, batch_size: int = 1):
        self.indices = range(rank, n, replicas)
        self.keyed = keyed
        batches = lambda items: -(-items // batch_size)  # noqa: E731
        self.padded = batches(len(range(0, n, replicas))) > batches(len(self.indices))

    def __iter__(self) -> Iterator[int]:
        indices = [*self.indices, *([0] if self.padded else [])]
        return iter([(-1, i) for i in indices]) if self.keyed else iter(indices)

    def __len__(self) -> int:
        return len(self.indices) + self.padded


class Padding(NamedTuple):
    """A validation batch that a rank runs only so that its collectives meet the other ranks' (ShardSampler)."""
    batch: Any


def check_batch(batch_size: int, replicas: int, world: Optional[int] = None) -> None:
    """A global batch shares out evenly among the data-parallel ranks (`world` processes, where tensor parallel
    ranks read one share together)."""
    if batch_size % replicas:
        among = (f"{replicas} processes" if world in (None, replicas) else
                 f"{replicas} data-parallel ranks ({world} processes / parallel.tp {world // replicas})")
        raise UserError(f"data.batch_size: {batch_size} does not divide among {among}; use a multiple of {replicas}")


class TrainData:
    """The training loader for one rank, and an endless stream of micro-batches on the device."""

    def __init__(self, dataset: Dataset, batch_size: int, grad_accum: int, replicas: int, rank: int,
                 shuffle: bool, seed: int, num_workers: Union[int, Loading], device: torch.device,
                 collate_fn: Callable = None):
        n = _length(dataset, "data.train")
        check_batch(batch_size, replicas)
        self.steps_per_epoch = n // batch_size // grad_accum
        if self.steps_per_epoch == 0:
            raise UserError(f"data.train: {n} items are fewer than one optimizer step takes "
                            f"(data.batch_size {batch_size} x trainer.grad_accum_steps {grad_accum})")
        self.batches_per_epoch = self.steps_per_epoch * grad_accum
        per_rank = batch_size // replicas
        self.seeded = _draws(dataset)
        self.sampler = EpochSampler(dataset, replicas, rank, shuffle, seed, per_rank, self.batches_per_epoch,
                                    keyed=self.seeded)
        self.collate = collate_fn or default
        self.loader = _loader(dataset, per_rank, self.sampler, num_workers, device, seed, self.collate, drop_last=True,
                              key="data.train")
        self.dataset, self.seed, self.device = dataset, seed, device

    is_stream = False

    def first_items(self, count: Optional[int] = None) -> Any:
        """This rank's first batch of items, fetched as training fetches them (for the check before training);
        or the first `count` items, from the start again when the dataset holds fewer (a micro-batch of any
        size, for python -m launcher.plan)."""
        keys = ([(0, i) for i in range(min(self.loader.batch_size, len(self.dataset)))] if count is None else
                [(0, i % len(self.dataset)) for i in range(count)])
        kept = item_rng.Kept()  # the check leaves the process's generators as they were
        try:
            return item_rng.fetched(_batched(self.dataset), keys, self.seed)
        finally:
            kept.back()

    def stream(self, position: Position) -> Iterator[Any]:
        """Micro-batches on the device from `position` on, across epochs. `position` says which batch
        was handed out last, so a checkpoint taken between two batches resumes with the next one."""
        return placed(self, position)

    def host_batches(self, position: Position) -> Iterator[tuple]:
        """((epoch, its batch number counted from 1), batch on the host), endlessly."""
        epoch, start = position.epoch, position.batch
        while True:
            self.sampler.set_epoch(epoch, start)
            for number, batch in enumerate(self.loader, start + 1):
                yield (epoch, number), batch
            epoch, start = epoch + 1, 0

    def arrive(self, place: tuple, position: Position) -> None:
        position.epoch, position.batch = place

    def state(self) -> None:
        return None  # the position says it all

    def close(self) -> None:
        shut(self.loader)


def val_batches(dataset: Optional[Dataset], batch_size: int, replicas: int, rank: int, num_workers: Union[int, Loading],
                device: torch.device, seed: int, collate_fn: Callable = None):
    """A re-iterable of validation batches on the device, or None without a validation set."""
    if dataset is None:
        return None
    n = _length(dataset, "data.val")
    size = max(batch_size // replicas, 1)
    sampler = ShardSampler(n, replicas, rank, keyed=_draws(dataset), batch_size=size)
    loader = _loader(dataset, size, sampler, num_workers, device, seed, collate_fn or default, drop_last=False,
                     key="data.val")

    return ValBatches(loader, device, sampler.padded)


class ValBatches:
    def __init__(self, loader: DataLoader, device: torch.device, padded: bool = False):
        self.loader, self.device, self.padded = loader, device, padded

    def __iter__(self) -> Iterator[Any]:
        last = len(self.loader) - 1
        for i, batch in enumerate(self.loader):
            batch = to_device(batch, self.device)
            yield Padding(batch) if self.padded and i == last else batch

    def close(self) -> None:
        shut(self.loader)


class TensorBatches(Dataset):
    """A TensorDataset that hands out whole batches: `__getitems__` indexes each tensor once."""

    def __init__(self, dataset: TensorDataset):
        self.tensors = dataset.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i):
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, indices) -> tuple:
        index = torch.as_tensor(indices)
        return tuple(t[index] for t in self.tensors)


def _draws(dataset: Dataset) -> bool:
    """Whether the dataset's items may draw random numbers: all but an in-memory TensorDataset's."""
    return type(dataset) is not TensorDataset


def _batched(dataset: Dataset) -> Dataset:
    return TensorBatches(dataset) if type(dataset) is TensorDataset else dataset


def _loader(dataset, batch_size, sampler, num_workers: Union[int, Loading], device, seed, collate_fn,
            drop_last, key: str) -> DataLoader:
    if _draws(dataset):  # the keyed sampler's batches, made and collated under their items' seeds
        dataset, collate_fn = item_rng.Seeded(dataset, seed, collate_fn), _as_is
    else:
        dataset = _batched(dataset)
    return Loader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, collate_fn=collate_fn, key=key,
        **loading(num_workers).options(device),
        # Its own generator: worker seeds never draw from (and so never shift) the global RNG.
        generator=torch.Generator().manual_seed(seed),
    )


def _as_is(batch: Any) -> Any:
    return batch


def _length(dataset: Dataset, key: str) -> int:
    if not hasattr(dataset, "__len__"):
        raise UserError(f"{key}: {type(dataset).__name__} has no len(); the launcher needs a map-style Dataset")
    try:
        n = len(dataset)
    except (TypeError, ValueError, OverflowError, IndexError) as e:  # a float, a negative, a huge number; no tensors
        raise UserError(f"{key}: len() of {type(dataset).__name__} fails: {first_line(e)}; __len__ must return "
                        f"the number of items, an int from 0 to {sys.maxsize}") from None
    if n == 0:
        raise UserError(f"{key}: the dataset is empty")
    return n

