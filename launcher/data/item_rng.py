"""The random numbers an item sees: a function of (seed, epoch, item index) alone.

Before a dataset makes item i of epoch e, torch's CPU generator, Python's `random` and numpy's global
generator are seeded from (the recipe's seed, e, i); a batch's collate function (a masking collator)
is seeded from its first item. So a random crop, noise or mask is the same whatever `data.num_workers`,
whatever the world size (the index is the item's place in the dataset, not in a rank's share), and
after a resume, which starts the loader somewhere else: DataLoader workers take their own seeds from
where the iterator starts. The process's own generators (dropout draws from them) are put back after
each batch is made, so a model's randomness is the same whether items are made in workers or not.

A dataset that fetches a whole batch at once (`__getitems__`) is seeded per batch, from its first
item: its draws then depend on how the batch is split among ranks. An in-memory TensorDataset draws
nothing and is not seeded.

A dataset whose items are themselves drawn from the epoch (a mixture of sources by weight,
launcher/data/text/mixture.py) has `at_epoch(epoch, index)`: it is asked for item `index` of `epoch` with
that, and `dataset[index]` is left to those who know no epoch.
"""

from __future__ import annotations

import random
from typing import Any, Callable, List, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

MASK = (1 << 64) - 1
COLLATE = 0x5DEECE66D  # set apart from every item's key: the collate function's seed


def key(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for item `index` of `epoch` (splitmix64 over the three; nearby keys share no bits)."""
    x = (seed * 0x9E3779B97F4A7C15 + (epoch + 1) * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def seed(value: int) -> None:
    """Seed the generators an item may draw from: torch's on the CPU, `random`, numpy's global one."""
    torch.default_generator.manual_seed(value)
    random.seed(value >> 32)
    np.random.seed(value & 0xFFFFFFFF)


class Kept:
    """The process's generators as they were when made, put back by `back()`. In a loader worker nothing
    else draws from them, and nothing is kept."""

    def __init__(self):
        self.main = get_worker_info() is None
        if self.main:
            self.states = (torch.default_generator.get_state(), random.getstate(), np.random.get_state())

    def back(self) -> None:
        if self.main:
            torch_state, random_state, numpy_state = self.states
            torch.default_generator.set_state(torch_state)
            random.setstate(random_state)
            np.random.set_state(numpy_state)


def fetched(dataset: Any, keys: Sequence[tuple], seed_: int) -> Any:
    """The items `keys` ((epoch, index) pairs) of `dataset`, each made under its own seed (or the batch
    under its first item's, where the dataset fetches a batch at once), not collated."""
    fetch = getattr(dataset, "__getitems__", None)
    if fetch:
        seed(key(seed_, *keys[0]))
        return fetch([index for _, index in keys])
    at_epoch = getattr(dataset, "at_epoch", None)
    data = []
    for epoch, index in keys:
        seed(key(seed_, epoch, index))
        data.append(at_epoch(epoch, index) if callable(at_epoch) else dataset[index])
    return data


def made(dataset: Any, keys: Sequence[tuple], collate: Callable[[Any], Any], seed_: int) -> Any:
    """The batch of items `keys`, each made under its own seed, collated under the first one's."""
    kept = Kept()
    try:
        data = fetched(dataset, keys, seed_)
        seed(key(seed_, *keys[0]) ^ COLLATE)
        return collate(data)
    finally:
        kept.back()


class Seeded(Dataset):
    """The loader's view of a dataset: asked for a batch of (epoch, index) keys (EpochSampler's, or
    ShardSampler's), it hands out the collated batch, each item made under its own seed."""

    def __init__(self, dataset: Dataset, seed_: int, collate: Callable[[Any], Any]):
        self.dataset, self.seed, self.collate = dataset, seed_, collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: List[tuple]) -> Any:
        return made(self.dataset, keys, self.collate, self.seed)
