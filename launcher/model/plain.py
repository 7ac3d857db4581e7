"""The plain model behind its wrappers (DataParallel, DDP, torch.compile), and its state_dict as the
plain model has it: wrapper prefixes removed, on the CPU with ties kept."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

PREFIXES = ("module.", "_orig_mod.")  # DataParallel / DDP, torch.compile


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DataParallel, DistributedDataParallel and torch.compile, however nested."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def strip_prefixes(state: Dict[str, Any]) -> Dict[str, Any]:
    """Remove wrapper prefixes (`module.`, `_orig_mod.`, in any nesting) so any state_dict fits the plain model."""
    state = dict(state)
    changed = True
    while changed:
        changed = False
        for prefix in PREFIXES:
            if state and all(k.startswith(prefix) for k in state):
                consume_prefix_in_state_dict_if_present(state, prefix)
                changed = True
    return state


def to_cpu(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """CPU copies that stay shared where the model shares them (tied embeddings are saved once)."""
    copies: Dict[tuple, torch.Tensor] = {}
    out = {}
    for key, tensor in state.items():
        ident = (tensor.device, tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if ident not in copies:
            copies[ident] = tensor.detach().cpu()
        out[key] = copies[ident]
    return out


def tied_names(model: nn.Module) -> List[List[str]]:
    """The names of each parameter a model holds under several (an input embedding tied to the output layer)."""
    names: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]
