"""DistributedDataParallel: one process per device, started by torchrun (or by the launcher through
torch.distributed.run). nccl on CUDA, gloo on the CPU."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from typing import Any, Callable, ContextManager, List

import torch
import torch.distributed as dist
from torch import nn

from launcher.errors import UserError
from launcher.strategies.base import Strategy, host_max

# A rank that waits longer than this for the others has lost them: fail instead of hanging.
TIMEOUT = datetime.timedelta(minutes=10)


class DDP(Strategy):
    name = "ddp"

    def setup(self) -> None:
        if self.placement.launched_by == "plain":
            raise UserError("strategy: ddp needs the rank variables torchrun sets (RANK, WORLD_SIZE, ...); "
                            "start it with torchrun, or let python -m launcher start torchrun for you")
        if self.placement.launched_by == "slurm" and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
            raise UserError("strategy: ddp in Slurm tasks started by srun needs MASTER_ADDR and MASTER_PORT "
                            "(the first node and a free port); the slurm/ templates set them, or use torchrun")
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        # Keys of an earlier attempt can outlive it in torchrun's store: after an elastic restart a
        # rank would then dial a dead peer's address. Each attempt gets its own namespace.
        rank, world = self.placement.rank, self.placement.world_size
        try:
            store, _, _ = next(dist.rendezvous(f"env://?rank={rank}&world_size={world}", timeout=TIMEOUT))
        except dist.DistNetworkError as e:  # rank 0 hosts the store there (unless torchrun's agent does)
            if "EADDRINUSE" not in str(e):
                raise
            raise UserError(f"environment: MASTER_PORT={os.environ.get('MASTER_PORT')} is in use on this machine, "
                            f"so rank 0 cannot wait there for the others; pick a free port for every rank, or "
                            f"start with torchrun --standalone, which finds one") from None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend="nccl" if cuda else "gloo", store=dist.PrefixStore(f"attempt_{attempt}", store),
                                rank=rank, world_size=world, timeout=TIMEOUT, device_id=self.device if cuda else None)
        # Host-side agreements (stop on a signal) go through gloo, so they never synchronise a GPU.
        self.host_group = dist.new_group(backend="gloo") if cuda else dist.group.WORLD

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def no_sync(self, model: nn.Module, skip: bool) -> ContextManager:
        return model.no_sync() if skip else contextlib.nullcontext()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(tensor) / self.placement.world_size  # gloo has no ReduceOp.AVG

    def max_over_ranks(self, values: List[int]) -> Callable[[], List[int]]:
        return host_max(values, self.host_group)

    def all_gather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.placement.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def teardown(self) -> None:
        # Free what still holds the process group (a DDP module in a reference cycle, the host group)
        # while the interpreter is whole: left to its finalization, gloo's threads could still hold
        # work whose tensors need the GIL, and the process aborted at exit ("terminate called
        # without an active exception", about 1 run in 30).
        self.host_group = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
