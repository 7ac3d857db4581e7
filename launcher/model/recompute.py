"""Activation checkpointing: the layers named in `trainer.activation_checkpointing` keep only their
inputs in forward and recompute their activations in backward (torch.utils.checkpoint, non-reentrant).

The module tree and the state_dict keys stay as they are (torch's checkpoint_wrapper would add
`_checkpoint_wrapped_module.` to every key): each such layer's class becomes a subclass of the same
name whose forward runs the original under checkpoint, as FSDP2 itself swaps classes. It composes with
DDP, FSDP2 (whose hooks run around the call, outside the recomputed region), DataParallel's replicas
(copies of the module, which keep its class) and torch.compile."""

from __future__ import annotations

import functools
from typing import List, Union

from torch import nn
from torch.utils.checkpoint import checkpoint

from launcher.errors import UserError
from launcher.model.modules import by_class, default_units, listed

KEY = "trainer.activation_checkpointing"


def chosen(model: nn.Module, setting: Union[str, List[str]]) -> List[str]:
    """The class names `trainer.activation_checkpointing` names: its list, or for `auto` the model's repeated
    blocks, found as fsdp.units: null finds its units (an HF model's `_no_split_modules`: LlamaDecoderLayer,
    Qwen2DecoderLayer, GPT2Block; else the layers of its ModuleLists)."""
    if setting != "auto":
        return list(setting)
    found = default_units(model)
    if not found:
        raise UserError(f"{KEY}: auto finds no repeated blocks in {type(model).__name__} (no _no_split_modules, no "
                        f"ModuleList of layers); name the classes to recompute, of its: {listed(model)}")
    return found


def apply(model: nn.Module, names: List[str]) -> int:
    """Make every module of the named classes recompute its activations; returns how many do. A layer inside
    another recomputed one is left as it is: the outer one recomputes it already."""
    chosen = by_class(model, names, KEY)
    inside = {id(sub) for m in chosen for sub in m.modules() if sub is not m}
    outer = [m for m in chosen if id(m) not in inside]
    for module in outer:
        module.__class__ = _recomputing(type(module))
    config = getattr(model, "config", None)
    if outer and getattr(config, "use_cache", False):
        # An HF model's KV cache would grow again as each layer is recomputed (its keys then outnumber the
        # mask); HF turns it off for its own gradient checkpointing, and training never reads it.
        config.use_cache = False
    return len(outer)


@functools.lru_cache(maxsize=None)
def _recomputing(cls: type) -> type:
    def forward(self, *args, **kwargs):
        return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
