"""Components only the tests use, named by `_target_` in test recipes."""

import torch

from recipes.components.mlp import MLP


class DivergesAt(MLP):
    """An MLP whose output turns to NaN from its `at`-th forward pass in training mode on."""

    def __init__(self, at: int, **kwargs):
        super().__init__(**kwargs)
        self.at, self.calls = at, 0

    def forward(self, x):
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.calls >= self.at:
                out = out * float("nan")
        return out


class NotAModule:
    def __init__(self, **kwargs):
        pass
