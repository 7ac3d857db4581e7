"""DataParallel: one process drives every selected GPU; DataParallel splits each batch itself.

The loss is computed on the gathered output, so it is already the mean over the global batch,
whatever the split. Without a GPU it says so once and runs as a single process.
"""

from __future__ import annotations

import torch
from torch import nn

from launcher.strategies.base import Strategy
from launcher.strategies.single import ALONE


class DP(Strategy):
    name = "dp"

    def notes(self) -> list[str]:
        out = []
        if self.device.type != "cuda":
            out.append("strategy: dp found no GPU; running as a single process on the CPU")
        if self.ddp.sync_batchnorm:
            # SyncBatchNorm synchronises between processes; DataParallel's replicas are threads of one.
            out.append("ddp.sync_batchnorm: DataParallel cannot synchronise BatchNorm: each GPU normalises its own "
                       "share of the batch (strategy=ddp synchronises them)" if self._parallel() else ALONE)
        return out

    def _parallel(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.device_count() >= 2

    def wrap(self, model: nn.Module) -> nn.Module:
        if not self._parallel():
            return model
        return nn.DataParallel(model, device_ids=list(range(torch.cuda.device_count())), output_device=self.device)
