"""Generated classification data: Gaussian blobs around random class centres, the same for a given seed."""

import torch
from torch.utils.data import Dataset


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
