"""FSDP2 (torch.distributed.fsdp.fully_shard): parameters, gradients and optimizer state sharded over the
ranks, one process per device as under DDP (started by torchrun, or by the launcher through it; gloo
on the CPU, nccl on CUDA). Each sharding unit (`fsdp.units`: class names, by default the model's
repeated layers) gathers its parameters for its forward and backward and reduce-scatters its gradients;
the root holds what is left. Checkpoints are written by every rank as shards (DCP), so a run resumes at
any world size; model.pt is gathered on rank 0."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from launcher import modules
from launcher.errors import UserError
from launcher.strategies.ddp import DDP

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class FSDP(DDP):
    name = "fsdp"
    sharded = True
    precision = "fp32"
    units: List[str] = []

    def settle(self, precision: str, grad_accum: int) -> Tuple[str, int, List[str]]:
        if precision == "fp16":  # the grad scaler's unscale has no kernel for sharded (DTensor) gradients
            raise UserError("precision: fp16 needs a grad scaler, which strategy fsdp does not shard; use precision=bf16 "
                            "(no scaler needed) or fp32 with fsdp, or fp16 with strategy=ddp")
        self.precision = precision
        return precision, grad_accum, []

    def notes(self) -> List[str]:
        if self.fsdp.cpu_offload and self.device.type != "cuda":
            return ["fsdp.cpu_offload: the run is on the CPU already; nothing to offload"]
        return []

    def wrapped(self) -> List[str]:
        units = ", ".join(self.units) or "none (the root alone)"
        return [f"fsdp: sharded over {self.placement.world_size} ranks; units {units}"]

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        names = self.fsdp.units if self.fsdp.units is not None else modules.default_units(model)
        found = modules.by_class(model, names, "fsdp.units") if names else []
        self.units = list(dict.fromkeys(type(m).__name__ for m in found))
        # Parameters compute in the recipe's precision (autocast still runs, as under every strategy);
        # gradients are reduced in fsdp.reduce_dtype and kept in fp32 shards for the optimizer.
        param_dtype = torch.bfloat16 if self.precision == "bf16" else None
        options = {"mesh": init_device_mesh(self.device.type, (self.placement.world_size,)),
                   "reshard_after_forward": self.fsdp.reshard_after_forward,
                   "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[self.fsdp.reduce_dtype]),
                   "offload_policy": CPUOffloadPolicy() if self.fsdp.cpu_offload and self.device.type == "cuda"
                   else OffloadPolicy()}
        for unit in reversed(found):  # innermost first: a unit inside another is its own shard group
            fully_shard(unit, **options)
        fully_shard(model, **options)
        return model

    def no_sync(self, model: nn.Module, skip: bool):
        # FSDP reads the flag when a unit's backward ends (DDP reads it in forward), so it is set for the
        # whole micro-step, forward and backward, and every micro-step sets it.
        self.unwrap(model).set_requires_gradient_sync(not skip)
        return super().no_sync(model, skip=False)

    def model_state(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathered unit by unit into rank 0's CPU memory: no rank holds the whole model on its device.
        return get_model_state_dict(self.unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
