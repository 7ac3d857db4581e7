"""Generated classification data: Gaussian blobs around random class centres, the same for a given seed."""

import torch
from torch.utils.data import Dataset, IterableDataset


class Blobs(Dataset):
    """`n` points in `dim` dimensions drawn around `classes` centres; `seed` fixes both centres and points.

    Train and validation sets share centres (`seed`) and differ in their points (`split`).
    """

    def __init__(self, n: int = 8192, dim: int = 32, classes: int = 10, spread: float = 1.0, seed: int = 0, split: int = 0):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, dim, generator=g) * 2.0
        g.manual_seed(seed * 7919 + split + 1)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = centres[self.y] + spread * torch.randn(n, dim, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def __getitems__(self, indices):
        """A whole batch at once (the launcher's loader asks for it): no Python per item."""
        index = torch.as_tensor(indices)
        return self.x[index], self.y[index]



class BlobStream(IterableDataset):
    """Blobs as a stream: the same points, one at a time, in an order shuffled per epoch (`set_epoch`), as
    a stream read from shards gives them. It cannot say where it stands: a resumed run skips what was read.
    """

    def __init__(self, n: int = 8192, dim: int = 32, classes: int = 10, spread: float = 1.0, seed: int = 0,
                 split: int = 0):
        self.points = Blobs(n, dim, classes, spread, seed, split)
        self.seed, self.epoch = seed, 0
        self.start = self.read = 0  # the first item of the next pass; the items of this epoch read

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.points), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        self.read, self.start = self.start, 0
        while self.read < len(order):
            item = self.points[int(order[self.read])]
            self.read += 1
            yield item


class ResumableBlobStream(BlobStream):
    """BlobStream that says where it stands, as HF datasets and torchdata's nodes do: a resumed run
    reads on from there."""

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "read": self.read}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.start = state["epoch"], state["read"]
