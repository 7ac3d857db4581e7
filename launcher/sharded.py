"""Sharded checkpoints: every rank writes its own shards with torch.distributed.checkpoint (DCP).

    checkpoints/step_<N>/.metadata          DCP's index of every tensor's shards (rank 0)
    checkpoints/step_<N>/__<rank>_0.distcp   each rank's shards: model, optimizer, and rank 0's run state
    checkpoints/step_<N>/manifest.json       written last by rank 0: every file's size and CRC-32

The state saved is {"model": ..., "optimizer": ..., "run": RunState}, keyed by the plain model's
parameter names, so DCP reshards it on load: any world size, any strategy, reads it.

Nothing in a checkpoint is run. DCP's own reader unpickles `.metadata` with plain pickle.load and
values other than tensors with torch.load(weights_only=False), either of which runs whatever a
crafted file names (and a forged manifest matches any file). Here `.metadata` is unpickled with
DCP's metadata classes only, and other values (the run state, the optimizer's hyperparameters) with
weights_only=True, as every other checkpoint file is.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, Metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from launcher import checkpoint
from launcher.errors import UserError, first_line

METADATA = ".metadata"


def write(folder: Path, state: Dict[str, Any], group: Optional[Any] = None) -> None:
    """Every rank's shards of `state` into `folder` (collective: every rank calls it)."""
    with _alone():
        dcp.save(state, storage_writer=FileSystemWriter(folder, sync_files=True), process_group=group,
                 no_dist=not dist.is_initialized())


def start(folder: Path, state: Dict[str, Any], group: Any):
    """The same, in the background: returns a future. The tensors are copied to host memory before it
    returns, so training may change them; the files are written on a thread, its collectives on `group`."""
    return dcp.async_save(state, storage_writer=FileSystemWriter(folder, sync_files=True), process_group=group)


def own_files(folder: Path, rank: int) -> Dict[str, Dict[str, Any]]:
    """The size and CRC-32 of each file this rank wrote (rank 0: DCP's index too), for the manifest."""
    names = [p.name for p in folder.glob(f"__{rank}_*.distcp")] + ([METADATA] if rank == 0 else [])
    return {name: {"size": (folder / name).stat().st_size, "crc32": checkpoint.crc32(folder / name)} for name in names}


def read(folder: Path, state: Dict[str, Any]) -> None:
    """Load a sharded checkpoint into `state` (shaped as it was saved: each tensor the destination of its
    values, resharded to this run), in place. Collective when a process group runs."""
    reader = _Reader(folder)
    if "model" in state:  # not the run state alone
        _check_fits(reader.metadata, state["model"])
    with _alone():
        dcp.load(state, storage_reader=reader, planner=_WeightsOnly(), no_dist=not dist.is_initialized())


class DoesNotFit(ValueError):
    """The checkpoint's keys or shapes differ from the model's (the first difference)."""


def _check_fits(metadata: Metadata, model: Dict[str, Any]) -> None:
    """The model's keys and shapes against those the checkpoint's index holds: the first difference as
    one line, as for a full checkpoint (DCP itself would say only `CheckpointException ranks:...`). Every
    rank reads the same index, so every rank stops here, before any collective of the load."""
    saved = {key[len("model."):]: meta.size for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    for key, tensor in model.items():
        if key not in saved:
            raise DoesNotFit(f"'{key}' is missing from the checkpoint")
        if tuple(saved[key]) != tuple(tensor.shape):  # a DTensor's shape is the whole tensor's
            raise DoesNotFit(f"'{key}' is {tuple(saved[key])} in the checkpoint, {tuple(tensor.shape)} in the model")
    extra = [key for key in saved if key not in model]
    if extra:
        raise DoesNotFit(f"the checkpoint has '{extra[0]}', which the model lacks")


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """DCP warns at every call without a process group that it assumes one process: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def model_weights(folder: Path) -> Dict[str, torch.Tensor]:
    """The full model of a sharded checkpoint, joined from every rank's shards in this process: tensors
    only, each allocated from DCP's index and filled by DCP."""
    reader = _Reader(folder)
    index = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in index.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with _alone():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len("model."):]: tensor for key, tensor in state.items()}


# What DCP's .metadata is made of (torch 2.13); anything else named in the file is refused.
_METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of DCP's metadata")


class _Reader(FileSystemReader):
    """DCP's reader, with `.metadata` unpickled by the restricted unpickler above, at once: DCP itself
    would log a refusal as a warning and go on to look for other files."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        path = Path(folder) / METADATA
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as e:  # UnpicklingError, EOFError, ... of a crafted, foreign or truncated file
            raise UserError(f"{path}: cannot read it as DCP's metadata; it is not loaded ({first_line(e)[:160]})") from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise UserError(f"{path}: not DCP's metadata (it holds {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def is_sharded(folder: Path) -> bool:
    return (folder / METADATA).is_file()


class _WeightsOnly(DefaultLoadPlanner):
    """DCP's planner, but objects other than tensors are unpickled with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = checkpoint.load_bytes(value)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper for nested keys

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
