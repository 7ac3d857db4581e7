"""Strategies, chosen by name: each wraps the model for a placement, says how to skip gradient
sync during accumulation, reduces metrics across ranks, and unwraps the model for saving.
Nothing outside this folder asks which strategy runs."""

from __future__ import annotations

from typing import Callable, Dict

from launcher.errors import UserError
from launcher.scheduler import Placement
from launcher.strategies.base import Strategy, unwrap
from launcher.strategies.single import Single

REGISTRY: Dict[str, Callable[[Placement], Strategy]] = {"single": Single}


def create(name: str, placement: Placement) -> Strategy:
    if name == "auto":
        name = "single" if placement.world_size == 1 else "ddp"
    if name not in REGISTRY:
        raise UserError(f"strategy: {name!r} is not available in this version; valid: auto, {', '.join(REGISTRY)}")
    return REGISTRY[name](placement)


__all__ = ["Strategy", "create", "unwrap"]
