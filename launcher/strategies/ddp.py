"""DistributedDataParallel: one process per device, started by torchrun (or by the launcher through
torch.distributed.run). nccl on CUDA, gloo on the CPU. The recipe's `ddp` section holds DDP's options;
the accelerate strategy hands them to its own DDP through the helpers at the end of this file."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.errors import UserError
from launcher.recipe.ranks import DDPConfig
from launcher.strategies.base import Strategy, end_process_group
from launcher.strategies.peers import host_max

# How long ranks wait for each other to start (the rendezvous); a collective waits `dist_timeout`.
TIMEOUT = datetime.timedelta(minutes=10)
FLIGHT_RECORDER = "flight_recorder"  # <run_dir>/flight_recorder/rank_<R>: NCCL's record of a hung collective


class DDP(Strategy):
    name = "ddp"
    module: Optional[nn.Module] = None  # the model DDP wraps, once wrapped: explain() names its parameters
    data_group: Any = None  # where metrics and item counts are summed: the data-parallel ranks (None: the world)

    def setup(self) -> None:
        if self.placement.launched_by == "plain":
            raise UserError("strategy: ddp needs the rank variables torchrun sets (RANK, WORLD_SIZE, ...); "
                            "start it with torchrun, or let python -m launcher start torchrun for you")
        if self.placement.launched_by == "slurm" and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
            raise UserError("strategy: ddp in Slurm tasks started by srun needs MASTER_ADDR and MASTER_PORT "
                            "(the first node and a free port); the slurm/ templates set them, or use torchrun")
        refuse_sync_batchnorm_off_cuda(self.ddp, self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
            self._flight_recorder()
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
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=self.timeout),
                                device_id=self.device if cuda else None)
        # Host-side agreements (stop on a signal) go through gloo, so they never synchronise a GPU.
        self.host_group = dist.new_group(backend="gloo") if cuda else dist.group.WORLD

    def flight_recorder(self) -> Optional[str]:
        if self.device.type != "cuda" or self.run_dir is None:
            return None
        return os.path.join(os.path.abspath(self.run_dir), FLIGHT_RECORDER)

    def _flight_recorder(self) -> None:
        """NCCL's flight recorder on, dumping each rank's last collectives into the run folder when one times
        out (before the process group starts, which reads these once; a user's own settings win)."""
        folder = self.flight_recorder()
        if folder is None:
            return
        os.makedirs(folder, exist_ok=True)
        # torch 2.8 renamed the recorder's variables (TORCH_NCCL_* -> TORCH_FR_*) and warns on the old names
        prefix = "TORCH_FR_" if _torch_at_least(2, 8) else "TORCH_NCCL_"
        dump = "TORCH_FR_DUMP_TEMP_FILE" if prefix == "TORCH_FR_" else "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
        buffer = "TORCH_FR_BUFFER_SIZE" if prefix == "TORCH_FR_" else "TORCH_NCCL_TRACE_BUFFER_SIZE"
        for var, value in ((buffer, "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"), (dump, f"{folder}/rank_")):
            os.environ.setdefault(var, value)

    def settle(self, precision: str, grad_accum: int) -> Tuple[str, int, List[str]]:
        refuse_static_graph_with_accumulation(self.ddp, grad_accum)
        return precision, grad_accum, []

    def wrap(self, model: nn.Module) -> nn.Module:
        self.module = with_sync_batchnorm(model, self.ddp)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(self.module, device_ids=ids, **options(self.ddp))

    def explain(self, error: BaseException) -> Optional[str]:
        return unused_parameters(error, self.module, self.ddp)

    def no_sync(self, model: nn.Module, skip: bool) -> ContextManager:
        return model.no_sync() if skip else contextlib.nullcontext()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.data_group)
        return tensor

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(tensor) / self.data_share()[0]  # gloo has no ReduceOp.AVG

    def max_over_ranks(self, values: List[int]) -> Callable[[], List[int]]:
        return host_max(values, self.host_group)

    def all_gather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.placement.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def checkpoint_group(self) -> Any:
        # Its collectives run on a writer thread while training's run on this one: never the same group.
        if getattr(self, "writer_group", None) is None:
            self.writer_group = dist.new_group(backend="gloo")
        return self.writer_group

    def teardown(self) -> None:
        # Free what still holds the process group (a DDP module in a reference cycle, the host group)
        # while the interpreter is whole: left to its finalization, gloo's threads could still hold
        # work whose tensors need the GIL, and the process aborted at exit ("terminate called
        # without an active exception", about 1 run in 30).
        self.host_group = self.writer_group = self.data_group = None
        gc.collect()
        end_process_group()


def options(ddp: DDPConfig) -> Dict[str, Any]:
    """The recipe's ddp section as DistributedDataParallel's keyword arguments."""
    out = {"find_unused_parameters": ddp.find_unused_parameters, "static_graph": ddp.static_graph,
           "gradient_as_bucket_view": ddp.gradient_as_bucket_view}
    if ddp.bucket_cap_mb is not None:  # else torch's default
        out["bucket_cap_mb"] = ddp.bucket_cap_mb
    return out


def refuse_sync_batchnorm_off_cuda(ddp: DDPConfig, device: torch.device) -> None:
    """Before the process group starts: SyncBatchNorm raises a ValueError at the first forward on the CPU."""
    if ddp.sync_batchnorm and device.type != "cuda":
        raise UserError(f"ddp.sync_batchnorm: needs CUDA devices (SyncBatchNorm has no CPU kernel); this run is on "
                        f"{device.type}: set ddp.sync_batchnorm=false to train here")


def refuse_static_graph_with_accumulation(ddp: DDPConfig, grad_accum: int) -> None:
    """torch 2.13's DDP with a static graph fails at the first backward run under no_sync, which every
    accumulation micro-step but the last is (an INTERNAL ASSERT: pytorch/pytorch#143580; the fix under
    review, #187732, found gradients left unreduced behind it too). Lift this when torch is fixed:
    tests/test_ddp_options.py watches for it."""
    if ddp.static_graph and grad_accum > 1:
        raise UserError(f"ddp.static_graph: torch's DDP fails with a static graph when gradients accumulate "
                        f"(trainer.grad_accum_steps={grad_accum} skips their sync; pytorch/pytorch#143580); set "
                        f"ddp.static_graph=false or trainer.grad_accum_steps=1")


def with_sync_batchnorm(model: nn.Module, ddp: DDPConfig) -> nn.Module:
    """The model, its BatchNorm layers made SyncBatchNorm when the recipe asks. They keep their parameters and
    buffers (the same tensors) and their state_dict keys, so checkpoints load into the plain model."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if ddp.sync_batchnorm else model


def unused_parameters(error: BaseException, module: Optional[nn.Module], ddp: DDPConfig) -> Optional[str]:
    """DDP's error for parameters that received no gradient (some 10 lines, naming parameter indices) as one
    line naming them and the recipe key that lets DDP skip them; None for any other error."""
    text = str(error)
    if not isinstance(error, RuntimeError) or ddp.find_unused_parameters or "find_unused_parameters" not in text:
        return None
    names = _unused_names(text, module)
    which = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    which = which or "some of the model's parameters"
    return (f"ddp.find_unused_parameters: {which} received no gradient in a step, "
            f"and DDP waits for every parameter's; set ddp.find_unused_parameters=true (or make every parameter "
            f"reach the loss, or freeze the unused ones with requires_grad=False)")


def _unused_names(text: str, module: Optional[nn.Module]) -> List[str]:
    """The names of the parameters DDP's message gives by index."""
    found = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)", text)
    if found is None or module is None:
        return []
    # DDP's indices count the parameters that require grad, module by module, each once (its
    # _build_params_for_reducer)
    names, seen = [], set()
    for prefix, sub in module.named_modules():
        for name, p in sub.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                names.append(f"{prefix}.{name}" if prefix else name)
    indices = [int(i) for i in found.group(1).split()]
    return [names[i] for i in indices if i < len(names)]


def _torch_at_least(major: int, minor: int) -> bool:
    found = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return found >= (major, minor)
