"""Pretrained weights read into a sharded model (fsdp built on the meta device): each rank reads only the
slices its shards hold, cast to the parameters' dtype tensor by tensor, so that no rank holds the whole
model. What it reads: an HF model folder and a .safetensors file (safetensors reads a slice's bytes
alone), a torch file or a full checkpoint's model.pt (memory-mapped: a slice's pages alone), a sharded
checkpoint (DCP reads each rank's part), a run folder (its newest weights). The keys and shapes are
checked as for a whole model first, every rank alike, before anything is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from launcher.checkpoint import files, fitting, formats, hf, manifest, sharded, storage, weights
from launcher.errors import UserError
from launcher.model.plain import tied_names


def load(model: nn.Module, path: Path) -> Optional[str]:
    """Fill the model's parameters (DTensor shards, allocated and uninitialised) and persistent buffers
    from `path`; returns where in it the weights were, as load_model_state does. Collective for a sharded
    checkpoint."""
    path = storage.location(path)  # a URL too
    files.file_or_folder(path)
    source = weights.newest_if_run_folder(path)
    if source.is_dir() and formats.of(source) is sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        manifest.verified(source)
        try:  # keyed as the runs that write them key the model (tied weights once)
            sharded.read(source, {"model": get_model_state_dict(model)})
        except sharded.DoesNotFit as e:
            raise UserError(f"{path}: does not fit this model: {e}") from None
        return f"its weights in {source}" if source != path else None
    target = model.state_dict()
    found = weights.published(_lazy(source), model, target)  # a mixture of experts' weights per expert, joined
    fitted, where = fitting.fit(found, target, path, None, ties=tied_names(model))
    with torch.no_grad():
        for name, tensor in target.items():
            _fill(tensor, fitted[name])
    return f"its weights in {source}" if source != path else where


def _lazy(path: Path) -> Dict[str, Any]:
    """The tensors at `path` (not a sharded checkpoint), read where they are sliced."""
    if path.suffix == ".safetensors" or (path.is_dir() and formats.of(path) is hf):
        return hf.slices(path)
    if path.is_dir():  # a full checkpoint: its model.pt, checked against the manifest
        manifest.verified(path)
        path = path / "model.pt"
    else:
        manifest.check_file(path)
    return files.load(path, mmap=True)


def _fill(tensor: torch.Tensor, source: Any) -> None:
    """This rank's part of `tensor` (a DTensor's local shard, or the whole of a plain tensor) from `source`."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local, index = tensor.to_local(), _index(tensor)
    else:
        local, index = tensor, ()
    if isinstance(source, hf.Slice):
        source.read(index, into=local)  # straight into the shard where the dtypes agree
    else:
        local.copy_(source[index].reshape(local.shape))


def _index(tensor: Any) -> Tuple[slice, ...]:
    """The global slice of a DTensor that this rank's shard holds (torch's own reckoning, as DCP's)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))
