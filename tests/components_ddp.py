"""Models for the tests of the recipe's ddp section, named by `_target_`."""

import torch
from torch import nn

from recipes.components.mlp import MLP


class UnusedHead(nn.Module):
    """The quickstart MLP with an auxiliary head whose output never reaches the loss, as when a user
    switches an auxiliary loss off: DDP waits for that head's gradients unless told not to."""

    def __init__(self, in_dim: int = 32, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.body = MLP(in_dim, hidden, classes)
        self.aux = nn.Linear(in_dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aux(x)  # computed, then dropped
        return self.body(x)


class WithBatchNorm(nn.Sequential):
    """A classifier with a BatchNorm layer, for ddp.sync_batchnorm."""

    def __init__(self, in_dim: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__(nn.Linear(in_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, classes))
