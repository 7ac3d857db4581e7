"""Reading DCP's files without running anything in them. DCP's own reader unpickles `.metadata` with
plain pickle.load and values other than tensors with torch.load(weights_only=False), either of which runs
whatever a crafted file names (and a forged manifest matches any file). Here `.metadata` is unpickled
with DCP's metadata classes only, and other values (the run state, the optimizer's hyperparameters) with
weights_only=True, as every other checkpoint file is. Imported only where a sharded checkpoint is read."""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from launcher.checkpoint import dcp_io, files, s3_connector, storage
from launcher.errors import UserError, first_line

METADATA = ".metadata"

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


def reader(folder: Path) -> FileSystemReader:
    """DCP's reader of a local folder, or of an object store's prefix (s3torchconnector's, or fsspec's: each
    item fetched by a ranged GET of its bytes, dcp_io.py), reading `.metadata` safely."""
    if storage.is_remote(folder) and s3_connector.carries(folder):
        return _safe(s3_connector.dcp_reader())(folder)
    if storage.is_remote(folder):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # not in dcp's namespace (torch 2.13)

        return _safe(dcp_io.ExactSlices, FsspecReader)(str(folder), **storage.fresh(folder.protocol))
    return _safe(FileSystemReader)(folder)


@functools.lru_cache(maxsize=None)
def _safe(*readers: type) -> type:
    return type(f"Safe{readers[-1].__name__}", (_SafeMetadata, *readers), {})


class _SafeMetadata:
    """A DCP reader's `.metadata` unpickled by the restricted unpickler above, at once: DCP itself would log
    a refusal as a warning and go on to look for other files."""

    def __init__(self, folder: Any, **options: Any):
        super().__init__(folder, **options)
        path = storage.location(folder) / METADATA
        try:
            with path.open("rb") as f:
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


class WeightsOnly(DefaultLoadPlanner):
    """DCP's planner, but objects other than tensors are unpickled with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = files.load_bytes(value)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper for nested keys

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
