"""The strategy contract, and unwrapping through every wrapper layer."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, List, Tuple

import torch
from torch import nn

from launcher.scheduler import Placement


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DataParallel, DistributedDataParallel and torch.compile, however nested."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


class Strategy:
    """One process's share of a run. The defaults are those of a single process."""

    name = "base"

    def __init__(self, placement: Placement):
        self.placement = placement
        self.device = torch.device(placement.device)

    def setup(self) -> None:
        """Start whatever the strategy needs (a process group); called before anything is built."""

    def settle(self, precision: str, grad_accum: int) -> Tuple[str, int, List[str]]:
        """The precision and accumulation to train with, when the launch method has a say in them."""
        return precision, grad_accum, []

    def notes(self) -> List[str]:
        """Lines for the console about how this strategy runs here (say, a fallback)."""
        return []

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model to train, already on `self.device`, wrapped for this strategy."""
        return model

    def no_sync(self, model: nn.Module, skip: bool) -> ContextManager:
        """A context in which backward does not synchronise gradients (accumulation micro-steps)."""
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap(model)

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def max_over_ranks(self, values: List[int]) -> Callable[[], List[int]]:
        """Start taking the element-wise largest of every rank's `values` through the host (never a
        device); the returned function waits for it. Started at one check and read at the next, it
        costs the loop no wait."""
        return lambda: values

    def barrier(self) -> None:
        pass

    def teardown(self) -> None:
        pass


def host_max(values: List[int], group) -> Callable[[], List[int]]:
    """An asynchronous element-wise MAX all-reduce of a few ints on a gloo group; call the result to
    wait for it."""
    import torch.distributed as dist

    flags = torch.tensor(values, dtype=torch.int64)
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def wait() -> List[int]:
        work.wait()
        return flags.tolist()  # a CPU tensor: no device sync

    return wait
