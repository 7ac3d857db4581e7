"""A model's submodules found by class name: the layers that recompute their activations
(`trainer.activation_checkpointing`) and the units FSDP shards (`fsdp.units`)."""

from __future__ import annotations

from typing import List

from torch import nn

from launcher.errors import UserError

CONTAINERS = ("ModuleList", "ModuleDict", "Sequential")  # torch's containers: left out of the classes listed
LISTED = 12


def by_class(model: nn.Module, names: List[str], key: str) -> List[nn.Module]:
    """Every submodule (the root too) whose class is named in `names`, outermost first. A name the model
    does not have is one line naming `key` and the classes it has."""
    have = classes(model)
    missing = [n for n in names if n not in have]
    if missing:
        raise UserError(f"{key}: the model has no class {', '.join(missing)}; its classes: {listed(model)}")
    return [m for m in model.modules() if type(m).__name__ in names]


def listed(model: nn.Module) -> str:
    """The model's classes, torch's containers left out, the first few named: for a message."""
    own = [c for c in classes(model) if c not in CONTAINERS]
    return ", ".join(own[:LISTED]) + (f" and {len(own) - LISTED} more" if len(own) > LISTED else "")


def classes(model: nn.Module) -> List[str]:
    """The class names of a model's modules, each once, in the order they first appear."""
    return list(dict.fromkeys(type(m).__name__ for m in model.modules()))


def default_units(model: nn.Module) -> List[str]:
    """The classes FSDP shards on their own when `fsdp.units` is null: the model's `_no_split_modules`
    (HF transformers models name their blocks there), else the classes of the layers held in its
    ModuleLists (the repeated blocks of most models), else none (the root alone)."""
    own = getattr(model, "_no_split_modules", None)
    if own:
        present = [n for n in own if n in classes(model)]
        if present:
            return present
    return list(dict.fromkeys(type(layer).__name__ for m in model.modules() if isinstance(m, nn.ModuleList)
                              for layer in m))
