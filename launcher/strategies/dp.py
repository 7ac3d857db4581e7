"""DataParallel: one process drives every selected GPU; DataParallel splits each batch itself.

The loss is computed on the gathered output, so it is already the mean over the global batch,
whatever the split. Without a GPU it says so once and runs as a single process.
"""

from __future__ import annotations

import torch
from torch import nn

from launcher.strategies.base import Strategy


class DP(Strategy):
    name = "dp"

    def notes(self) -> list[str]:
        if self.device.type != "cuda":
            return ["strategy: dp found no GPU; running as a single process on the CPU"]
        return []

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.device.type != "cuda" or torch.cuda.device_count() < 2:
            return model
        return nn.DataParallel(model, device_ids=list(range(torch.cuda.device_count())), output_device=self.device)
