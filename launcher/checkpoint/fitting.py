"""Whether weights fit a model: the same keys and shapes, with the weights found where other tools nest
them (a Lightning .ckpt's state_dict, {"model": ...}) and wrapper prefixes removed. A misfit is one
line naming the first differing key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from launcher.errors import UserError
from launcher.plain import strip_prefixes

# Where other tools nest a model's weights in their files (Lightning's .ckpt: state_dict).
NESTINGS = ("state_dict", "model", "model_state_dict", "module", "net")


def fit(state: Any, expected: Dict[str, Any], path: Path, where: Optional[str] = None,
        ties: Optional[List[List[str]]] = None) -> tuple[Dict[str, torch.Tensor], Optional[str]]:
    """The weights in `state` (read from `path`) keyed and shaped as the model's `expected` state_dict, and
    where in the file they were; one line naming the first difference if they do not fit. The values may
    be tensors or stand for them (a shape, read later: hf.Slice); `ties` are the names of each parameter
    the model holds under several (found from the tensors' storage when not given)."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise UserError(f"{path}: not a model state_dict (a mapping of parameter names to tensors)")
    if not all(_tensor_like(v) for v in state.values()):
        state, where = _nested(state, path)
    state = strip_prefixes(state)
    if state.keys() != expected.keys():
        state, where = _common_prefix_removed(state, expected, where)
    state = _ties_filled(state, expected, ties)
    inside = f" ({where})" if where else ""
    for key, tensor in expected.items():
        if key not in state:
            raise UserError(f"{path}{inside}: does not fit this model: '{key}' is missing from the file")
        got = state[key]
        if got.shape != tensor.shape:
            raise UserError(f"{path}{inside}: does not fit this model: '{key}' is {tuple(got.shape)} in the file, "
                            f"{tuple(tensor.shape)} in the model")
    extra = [k for k in state if k not in expected]
    if extra:
        raise UserError(f"{path}{inside}: does not fit this model: the file has '{extra[0]}', which the model lacks")
    return state, where


def _tensor_like(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or isinstance(getattr(value, "shape", None), torch.Size)


def _ties_filled(state: Dict[str, Any], expected: Dict[str, Any], ties: Optional[List[List[str]]]) -> Dict[str, Any]:
    """A file that holds one name of a tied parameter (an HF folder keeps the input embedding and leaves out
    the output layer tied to it): the model's other names of that parameter take its tensor."""
    missing = [k for k in expected if k not in state]
    if not missing:
        return state
    names: Dict[tuple, list] = {}
    for key, tensor in expected.items():
        if ties is None and isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" and tensor.numel():
            names.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape), []).append(key)
    filled = dict(state)
    for aliases in (ties if ties is not None else names.values()):
        present = [k for k in aliases if k in state]
        for key in aliases:
            if key not in state and present:
                filled[key] = state[present[0]]
    return filled


def _nested(state: Dict[str, Any], path: Path) -> tuple[Dict[str, torch.Tensor], str]:
    key = next((k for k in NESTINGS if isinstance(state.get(k), dict) and state[k]
                and all(_tensor_like(v) for v in state[k].values())), None)
    if key is None:
        keys = ", ".join(repr(k) for k in list(state)[:6])
        raise UserError(f"{path}: not a model state_dict: its keys ({keys}) hold more than tensors, and none "
                        f"of {', '.join(NESTINGS)} holds the weights")
    return state[key], f"the weights under '{key}'"


def _common_prefix_removed(state: Dict[str, Any], expected: Dict[str, Any],
                           where: Optional[str]) -> tuple[Dict[str, Any], Optional[str]]:
    """Weights under one common first name (Lightning's `model.`) without it, where that makes them fit."""
    heads = {k.split(".", 1)[0] for k in state}
    if len(heads) == 1 and all("." in k for k in state):
        head = heads.pop()
        stripped = {k[len(head) + 1:]: v for k, v in state.items()}
        if stripped.keys() == expected.keys():
            return stripped, f"{where or 'the weights'}, prefix '{head}.' removed"
    return state, where
