"""Strategies, chosen by name: each wraps the model for a placement, says how to skip gradient
sync during accumulation, reduces metrics across ranks, and unwraps the model for saving.
Nothing outside this folder asks which strategy runs."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from launcher.errors import UserError
from launcher.recipe.ranks import DDPConfig, FSDPConfig, ParallelConfig
from launcher.placement.scheduler import Placement
from launcher.model.plain import unwrap
from launcher.strategies.base import Strategy
from launcher.strategies.ddp import DDP
from launcher.strategies.dp import DP
from launcher.strategies.fsdp import FSDP
from launcher.strategies.single import Single

def _accelerate(placement: Placement, ddp: Optional[DDPConfig] = None, fsdp: Optional[FSDPConfig] = None,
                parallel: Optional[ParallelConfig] = None) -> Strategy:
    from launcher.strategies.accelerate import Accelerate  # imports accelerate only when chosen

    return Accelerate(placement, ddp, fsdp)


REGISTRY: Dict[str, Callable[..., Strategy]] = {
    "single": Single, "dp": DP, "ddp": DDP, "fsdp": FSDP, "accelerate": _accelerate}
ONE_PROCESS = ("single", "dp")
TORCHRUN = ("ddp", "fsdp")  # one process per device: asked for in a plain process, the launcher starts torchrun


def resolve(name: str, placement: Placement) -> str:
    """The strategy `auto` stands for here."""
    if name == "auto":
        if placement.launched_by == "accelerate":
            return "accelerate"
        return "single" if placement.world_size == 1 else "ddp"
    return name


def must_spawn(name: str, placement: Placement) -> bool:
    """DDP or FSDP asked for in a plain process: the launcher starts torchrun itself."""
    return name in TORCHRUN and placement.launched_by == "plain"


def create(name: str, placement: Placement, ddp: Optional[DDPConfig] = None, fsdp: Optional[FSDPConfig] = None,
           timeout: float = 600, run_dir: Optional[str] = None, parallel: Optional[ParallelConfig] = None,
           fault_tolerance: Optional[Any] = None, recipe: Optional[Any] = None) -> Strategy:
    """The strategy for this placement, holding the recipe's `ddp`, `fsdp` and `parallel` sections, its
    `dist_timeout` (seconds) and the run folder (where NCCL's flight recorder dumps); made fault tolerant by
    the recipe's `fault_tolerance` section when it has one (`recipe`, resolved, is what joining groups check)."""
    name = resolve(name, placement)
    if name in ONE_PROCESS and placement.world_size > 1:
        raise UserError(f"strategy: {name} runs one process, but this is one of WORLD_SIZE={placement.world_size} "
                        f"started by {placement.launched_by}; use strategy=ddp (or auto)")
    if name == "fsdp" and parallel is not None and parallel.pp > 1:
        from launcher.strategies.pipeline import Pipeline  # imports torch's pipelining only when chosen

        strategy: Strategy = Pipeline(placement, ddp, fsdp, parallel)
    elif fault_tolerance is not None:
        from launcher.strategies.fault_tolerant import around  # imports torchft only when a recipe asks for it

        strategy = around(REGISTRY[name], fault_tolerance, recipe)(placement, ddp, fsdp, parallel)
    else:
        strategy = REGISTRY[name](placement, ddp, fsdp, parallel)
    strategy.timeout, strategy.run_dir = timeout, run_dir
    return strategy


__all__ = ["Strategy", "create", "unwrap"]
