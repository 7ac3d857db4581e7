"""Submodules found by class name (provisional: replaced by the activation-checkpointing branch's)."""

from __future__ import annotations

from typing import List

from torch import nn

from launcher.errors import UserError


def by_class(model: nn.Module, names: List[str], key: str) -> List[nn.Module]:
    have = list(dict.fromkeys(type(m).__name__ for m in model.modules()))
    missing = [n for n in names if n not in have]
    if missing:
        raise UserError(f"{key}: the model has no class {', '.join(missing)}; its classes: {', '.join(have[:12])}")
    return [m for m in model.modules() if type(m).__name__ in names]


def default_units(model: nn.Module) -> List[str]:
    own = getattr(model, "_no_split_modules", None)
    if own:
        return list(own)
    return list(dict.fromkeys(type(c).__name__ for m in model.modules() if isinstance(m, nn.ModuleList) for c in m))
