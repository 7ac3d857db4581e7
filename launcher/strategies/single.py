"""One process on one device: the reference every other strategy must match."""

from launcher.strategies.base import Strategy


class Single(Strategy):
    name = "single"
