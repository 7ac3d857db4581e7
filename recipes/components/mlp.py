"""A small multilayer perceptron classifier (no dropout, no batch statistics: strategies give equal weights)."""

from torch import nn


class MLP(nn.Sequential):
    def __init__(self, in_dim: int = 32, hidden: int = 128, classes: int = 10, layers: int = 2):
        dims = [in_dim] + [hidden] * layers
        blocks = []
        for a, b in zip(dims, dims[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        super().__init__(*blocks, nn.Linear(dims[-1], classes))

    def flops_per_sample(self) -> int:
        """Training FLOPs of one sample: 6 per weight (2 forward, 4 backward); read for MFU in the logs."""
        return 6 * sum(m.weight.numel() for m in self if isinstance(m, nn.Linear))
