"""Whether weights fit a model: the same keys and shapes, with the weights found where other tools nest
them (a Lightning .ckpt's state_dict, {"model": ...}) and wrapper prefixes removed, and one tensor for
each parameter the model ties. A misfit is one line naming the first differing key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from launcher.checkpoint import adapters
from launcher.errors import UserError, shown
from launcher.model.plain import strip_prefixes

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
    inside = f" ({where})" if where else ""
    peft = [k for k in state if adapters.is_adapter_key(k)]
    if peft and not any(adapters.is_adapter_key(k) for k in expected):
        raise UserError(f"{path}{inside}: {adapters.merge_first(path, shown(peft[0], 120))}")
    groups = _tie_groups(expected, ties)
    given = set(state)
    state = _ties_filled(state, groups)
    for key, tensor in expected.items():
        if key not in state:
            raise UserError(f"{path}{inside}: does not fit this model: '{key}' is missing from the file")
        got = state[key]
        if got.shape != tensor.shape:
            raise UserError(f"{path}{inside}: does not fit this model: '{key}' is {tuple(got.shape)} in the file, "
                            f"{tuple(tensor.shape)} in the model")
    extra = [k for k in state if k not in expected]
    if extra:
        raise UserError(f"{path}{inside}: does not fit this model: the file has '{shown(extra[0], 120)}', which the model "
                        f"lacks")
    _ties_agree(state, groups, given, f"{path}{inside}")
    return state, where


def _tensor_like(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or isinstance(getattr(value, "shape", None), torch.Size)


def _tie_groups(expected: Dict[str, Any], ties: Optional[List[List[str]]]) -> List[List[str]]:
    """The names of each parameter the model holds under several: `ties`, or found from the storage of
    `expected`'s tensors."""
    if ties is not None:
        return ties
    names: Dict[tuple, list] = {}
    for key, tensor in expected.items():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" and tensor.numel():
            # A DTensor (fsdp's shard, tp's split) has no storage of its own: its names share its local tensor's.
            # The storage's own address (_cdata, as torch.save dedups storages), not its data's: a rank's empty
            # shards all have data at 0.
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            names.setdefault((local.untyped_storage()._cdata, local.storage_offset(), tensor.shape), []).append(key)
    return [aliases for aliases in names.values() if len(aliases) > 1]


def _ties_filled(state: Dict[str, Any], groups: List[List[str]]) -> Dict[str, Any]:
    """A file that holds one name of a tied parameter (an HF folder keeps the input embedding and leaves out
    the output layer tied to it): the model's other names of that parameter take its tensor."""
    filled = dict(state)
    for aliases in groups:
        present = [k for k in aliases if k in state]
        for key in aliases:
            if key not in state and present:
                filled[key] = state[present[0]]
    return filled


def _ties_agree(state: Dict[str, Any], groups: List[List[str]], given: set, where: str) -> None:
    """A file that holds two names of one tied parameter holds one tensor under both (the copies an export
    writes): two different tensors would load one over the other, and one of them would be lost. from_pretrained
    unties them; here the model must be built untied to take both."""
    for aliases in groups:
        present = [k for k in aliases if k in given]
        for key in present[1:]:
            if not _same(state[present[0]], state[key]):
                raise UserError(f"{where}: '{key}' differs from '{present[0]}' in the file, and this model ties them "
                                f"(one parameter): loading both would lose one; build the model untied, as "
                                f"from_pretrained does with such a file (an HF config's tie_word_embeddings: false, "
                                f"e.g. model.config.tie_word_embeddings=false), or leave '{key}' out of the file")


COMPARED = 64 * 2**20  # bytes of each of two tensors compared at a time (a file's slices are read, not held)


def _same(a: Any, b: Any) -> bool:
    """Whether two tensors of a file (tensors, or hf.Slice read a few rows at a time) hold the same values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and a.stride() == b.stride() and a.data_ptr() == b.data_ptr():
        return True  # one tensor under two names (torch.save keeps a tie)
    if a.shape != b.shape:
        return False
    if not a.shape:
        return _equal(_part(a, ()), _part(b, ()))
    step = max(1, COMPARED // max(1, a.shape[1:].numel() * a.dtype.itemsize))
    return all(_equal(_part(a, (slice(i, i + step),)), _part(b, (slice(i, i + step),)))
               for i in range(0, a.shape[0], step))


def _part(tensor: Any, index: tuple) -> torch.Tensor:
    return tensor.read(index) if callable(getattr(tensor, "read", None)) else tensor[index]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) if a.dtype == b.dtype else torch.equal(a.double(), b.double())


def _nested(state: Dict[str, Any], path: Path) -> tuple[Dict[str, torch.Tensor], str]:
    key = next((k for k in NESTINGS if isinstance(state.get(k), dict) and state[k]
                and all(_tensor_like(v) for v in state[k].values())), None)
    if key is None:
        keys = ", ".join(f"'{shown(k, 60)}'" for k in list(state)[:6])
        raise UserError(f"{path}: not a model state_dict: its keys ({keys}) hold more than tensors, and none "
                        f"of {', '.join(NESTINGS)} holds the weights")
    return state[key], f"the weights under '{key}'"  # one of NESTINGS


def _common_prefix_removed(state: Dict[str, Any], expected: Dict[str, Any],
                           where: Optional[str]) -> tuple[Dict[str, Any], Optional[str]]:
    """Weights under one common first name (Lightning's `model.`) without it, where that makes them fit."""
    heads = {k.split(".", 1)[0] for k in state}
    if len(heads) == 1 and all("." in k for k in state):
        head = heads.pop()
        stripped = {k[len(head) + 1:]: v for k, v in state.items()}
        if stripped.keys() == expected.keys():
            return stripped, f"{where or 'the weights'}, prefix '{shown(head, 60)}.' removed"
    return state, where
