"""One process on one device: the reference every other strategy must match."""

from typing import List

from launcher.strategies.base import Strategy

ALONE = "ddp.sync_batchnorm: one process has no other to share BatchNorm statistics with; the layers stay BatchNorm"


class Single(Strategy):
    name = "single"

    def notes(self) -> List[str]:
        return [ALONE] if self.ddp.sync_batchnorm else []
