"""The plain model's weights from whatever a user names: a checkpoint folder of any format, a run folder
(its newest weights) or a state_dict file, checked against the manifest first. export and
checkpoint.init_from read weights through here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from launcher.checkpoint import adapters, files, fitting, formats, hf, hf_layout, layout, manifest, storage
from launcher.errors import UserError
from launcher.model.plain import strip_prefixes


def read(path: Path, mmap: bool = False) -> Tuple[Dict[str, torch.Tensor], str]:
    """The plain model's weights in `path` (a checkpoint folder, a run folder or a file), and what they were
    read from."""
    path = storage.location(path)  # a URL too
    files.file_or_folder(path)
    path = newest_if_run_folder(path)
    if path.is_dir():
        return of_checkpoint(path), str(path)
    state = _file(path, mmap=mmap)
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise UserError(f"{path}: not a model state_dict (a mapping of parameter names to tensors)")
    manifest.check_file(path)
    return strip_prefixes(state), str(path)


def lazy(path: Path) -> Tuple["hf.Tensors", str]:
    """The plain model's weights in `path`, as read() finds them, read a few at a time where the format
    allows (a sharded checkpoint, an HF folder, a .safetensors file; a torch file is memory-mapped), and
    what they were read from."""
    path = storage.location(path)  # a URL too
    files.file_or_folder(path)
    path = newest_if_run_folder(path)
    if path.is_dir():
        return formats.of(path).lazy_weights(path), str(path)
    if path.suffix == ".safetensors":
        return hf.Tensors.sliced(hf.slices(path)), str(path)
    state, source = read(path, mmap=True)
    return hf.Tensors.of(state), source


def of_checkpoint(folder: Path) -> Dict[str, torch.Tensor]:
    """The model's weights of a checkpoint folder of any format (checked as the format checks its files)."""
    return formats.of(folder).model_weights(folder)


def newest_if_run_folder(path: Path) -> Path:
    """`path`, or where a run folder's newest weights are (newest_in_run_folder)."""
    if path.is_dir() and ((path / "checkpoints").is_dir() or (path / "recipe.yaml").is_file()):
        return newest_in_run_folder(path)
    return path


def newest_in_run_folder(folder: Path) -> Path:
    """A run folder's newest weights: its newest complete checkpoint (a finished run's last one holds what its
    model.pt holds; a run continued and killed later holds newer ones than a model.pt left from before), else
    its model.pt. Its checkpoints are where its recipe put them (checkpoint.dir: an object store too)."""
    checkpoints = layout.of_run(folder)
    if storage.is_remote(checkpoints):
        storage.reachable(checkpoints, f"{folder / 'recipe.yaml'}: checkpoint.dir")
    found = layout.complete(checkpoints)
    if found:
        return found[-1]
    if (folder / "model.pt").is_file():
        return folder / "model.pt"
    raise UserError(f"{folder}: a run folder without a model.pt or a complete checkpoint")


def load_model_state(model: torch.nn.Module, path: Path, map_location: Any = "cpu") -> Optional[str]:
    """Load a state_dict file, a checkpoint folder or a run folder into the plain model with strict=True,
    naming the first difference if it does not fit. Weights nested under a key (a Lightning .ckpt's
    state_dict, {"model": ...}) load too, with a common prefix such as Lightning's `model.` removed when
    that makes them fit; the return value then says where they were found. A file in a checkpoint folder is
    first checked against the manifest's CRC-32."""
    path = storage.location(path)  # a URL too
    expected = model.state_dict()
    state, where = _read(path, map_location)
    view = adapters.base_view(model, expected)
    state = published(state, model, view[0] if view is not None else expected)
    if view is None:
        fitted, where = fitting.fit(state, expected, path, where)
        model.load_state_dict(_tensors(fitted, map_location), strict=True)
        return where
    try:  # a checkpoint of this adapted model itself
        fitted, said = fitting.fit(state, expected, path, where)
        model.load_state_dict(_tensors(fitted, map_location), strict=True)
        return said
    except UserError:  # the base model's weights (a pretrained folder): the adapters stay as built
        base, back, adapter_keys = view
        fitted, said = fitting.fit(state, base, path, where)
    missing, unexpected = model.load_state_dict({back[k]: v for k, v in _tensors(fitted, map_location).items()},
                                                strict=False)
    assert sorted(missing) == sorted(adapter_keys) and not unexpected, (missing, unexpected)
    return "; ".join([*([said] if said else []), f"the base model's weights; its {len(adapter_keys)} adapter tensors as built"])


def published(state: Any, model: torch.nn.Module, expected: Dict[str, Any]) -> Any:
    """An HF folder's tensors keyed as the model's (`expected`) where the folder holds them as published (a
    mixture of experts' weights per expert, hf_layout.py); other weights as they are."""
    if isinstance(state, dict) and state and all(isinstance(v, hf.Slice) for v in state.values()):
        return hf_layout.as_model(state, model, {k: v.shape for k, v in expected.items()})
    return state


def _read(path: Path, map_location: Any = "cpu") -> Tuple[Any, Optional[str]]:
    """What `path` holds, to fit to a model, and where in it the weights were (a run folder's newest). An HF
    folder's or a .safetensors file's tensors are hf.Slice, headers alone: nothing is read until they fit."""
    files.file_or_folder(path)
    source = newest_if_run_folder(path) if path.is_dir() else path
    if source.suffix == ".safetensors" or (source.is_dir() and formats.of(source) is hf):
        if not source.is_dir():
            manifest.check_file(source)
        return hf.slices(source), (f"its weights in {source}" if source != path else None)
    if path.is_dir():  # a checkpoint folder of any format, or a run folder (checked as export checks them)
        weights, source = read(path)
        state = {k: v.to(map_location) for k, v in weights.items()}
        return state, (f"its weights in {source}" if str(source) != str(path) else None)
    manifest.check_file(path)
    return _file(path, map_location), None


def _tensors(fitted: Dict[str, Any], map_location: Any) -> Dict[str, torch.Tensor]:
    """The fitted weights as tensors: an hf.Slice (or experts joined from them) read now, one tensor at a time."""
    return {k: (v.read() if not isinstance(v, torch.Tensor) else v).to(map_location) for k, v in fitted.items()}


def _file(path: Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """A weights file: safetensors (read without unpickling anything) or torch's (weights only)."""
    if path.suffix == ".safetensors":
        return {k: v.to(map_location) for k, v in hf.safetensors_file(path).items()}
    return files.load(path, map_location, mmap=mmap)
