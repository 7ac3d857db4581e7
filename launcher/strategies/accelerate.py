"""HuggingFace Accelerate: under `accelerate launch` (one or several processes, CPU or GPU) or in a
plain process. Only this module imports accelerate.

Accelerate prepares the model (device, DDP), skips gradient sync, reduces, gathers and unwraps.
The sample order stays the launcher's (one permutation per (seed, epoch), interleaved), so
the loader is not prepared: Accelerate's sharding would give each process other samples. Autocast,
the grad scaler and accumulation stay the launcher's too, with the values `accelerate launch` sets
(flags or its config file) when they differ from the recipe's, as one console line says.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, ContextManager, List, Optional, Tuple

import torch
from torch import nn

from launcher.errors import UserError, first_line
from launcher.strategies.base import Strategy, end_process_group
from launcher.strategies.peers import host_max
from launcher.strategies.ddp import (options, refuse_static_graph_with_accumulation, refuse_sync_batchnorm_off_cuda,
                                     unused_parameters, with_sync_batchnorm)

PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
ACCUMULATION = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"


class Accelerate(Strategy):
    name = "accelerate"
    module: Optional[nn.Module] = None  # the model prepared, once wrapped: explain() names its parameters

    def setup(self) -> None:
        refuse_sync_batchnorm_off_cuda(self.ddp, self.device)
        try:
            from accelerate import Accelerator
            from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
        except ImportError:
            raise UserError("strategy: accelerate needs the accelerate package: "
                            "pip install 'launcher[accelerate]' (or pip install accelerate)") from None
        steps = os.environ.get(ACCUMULATION)
        if steps is not None and not (steps.isdigit() and int(steps) >= 1):
            raise UserError(f"environment variable {ACCUMULATION}={steps!r} is not a positive integer "
                            f"(accelerate launch --gradient_accumulation_steps N sets it)")
        try:
            # Accelerate's DDP takes the recipe's ddp section; it passes on only what differs from its
            # defaults, which are torch's (its bucket_cap_mb, 25, is torch's too).
            self.accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=1,
                                           cpu=self.device.type == "cpu",
                                           kwargs_handlers=[DistributedDataParallelKwargs(**options(self.ddp)),
                                                            InitProcessGroupKwargs(timeout=timedelta(seconds=self.timeout))])
        except ValueError as e:
            # Accelerate parses its ACCELERATE_* variables here (flags, choices), without naming the one it refuses.
            named = sorted(f"{k}={v!r}" for k, v in os.environ.items() if k.startswith("ACCELERATE_"))
            if not named:
                raise
            raise UserError(f"accelerate refused its environment ({first_line(e)}); check {', '.join(named)}") from None
        if self.placement.world_size > 1:  # host-side agreements go through gloo: no device sync
            self.host_group = torch.distributed.new_group(backend="gloo")

    def settle(self, precision: str, grad_accum: int) -> Tuple[str, int, List[str]]:
        notes = []
        launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
        if launched is not None and launched not in PRECISION:
            raise UserError(f"ACCELERATE_MIXED_PRECISION={launched}: the launcher supports "
                            f"{', '.join(PRECISION)} (precision fp32, fp16, bf16)")
        if launched is not None and PRECISION[launched] != precision:
            if launched != "no":  # "no" is also accelerate's default: only a choice made there wins
                notes.append(f"accelerate launch sets mixed_precision {launched}: it wins over the recipe's precision {precision}")
                precision = PRECISION[launched]
            else:
                notes.append(f"the recipe's precision {precision} wins over accelerate launch's mixed_precision no (its default)")
        steps = os.environ.get(ACCUMULATION)  # checked in setup
        if steps is not None and int(steps) != grad_accum:
            notes.append(f"accelerate sets gradient_accumulation_steps {steps}: it wins over the recipe's "
                         f"trainer.grad_accum_steps {grad_accum}")
            grad_accum = int(steps)
        refuse_static_graph_with_accumulation(self.ddp, grad_accum)
        return precision, grad_accum, notes

    def wrap(self, model: nn.Module) -> nn.Module:
        self.module = with_sync_batchnorm(model, self.ddp)
        return self.accelerator.prepare_model(self.module)

    def explain(self, error: BaseException) -> Optional[str]:
        return unused_parameters(error, self.module, self.ddp)

    def no_sync(self, model: nn.Module, skip: bool) -> ContextManager:
        return self.accelerator.no_sync(model) if skip else contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="mean")

    def all_gather_object(self, obj: Any) -> List[Any]:
        from accelerate.utils import gather_object

        return gather_object([obj]) if self.placement.world_size > 1 else [obj]

    def max_over_ranks(self, values: List[int]) -> Callable[[], List[int]]:
        if self.placement.world_size == 1:
            return lambda: values
        return host_max(values, self.host_group)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def teardown(self) -> None:
        from accelerate.state import AcceleratorState

        self.accelerator.end_training()
        end_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)  # accelerate keeps process-wide singletons
