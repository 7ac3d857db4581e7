"""DCP's file streams, each read or written once. Imported only where a sharded checkpoint is written or read.

- Writing: the size and CRC-32 of each file DCP writes are kept as its bytes go by (files.recorder), so that a
  rank lists its files in the manifest without reading them back: from an object store that would download
  every shard again right after uploading it.
- Reading from an object store: each item DCP asks for (a tensor, the run state) is fetched by one ranged
  GET of its own bytes. fsspec's default read-ahead would fetch up to 50 MB past it, so that reading the run
  state alone downloaded a whole shard, and each load of a part of a shard downloaded it again."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from pathlib import Path
from typing import Any, Dict, Iterator

from launcher.checkpoint import files, storage

# What this process's DCP writers wrote, by path: DCP returns nothing per file to its caller, and the rank that
# seals the save may be another call than the one that wrote (an asynchronous save). Each entry is taken once.
_written: Dict[str, Dict[str, Any]] = {}
_lock = threading.Lock()


def recording(writer: Any) -> Any:
    """A DCP writer whose files' sizes and CRC-32s are kept as they are written (its .metadata's too)."""
    writer.fs = _Recording(writer.fs)
    return writer


def written(path: Path) -> Dict[str, Any]:
    """The size and CRC-32 of a file DCP wrote, for the manifest: as kept while this process wrote it, where
    it did and the file still has that size; else read back from where it is."""
    with _lock:
        kept = _written.pop(str(path), None)
    size = storage.size(path)
    if kept is not None and kept["size"] == size:
        return kept
    return {"size": size, "crc32": files.crc32(path)}


class _Wrapped:
    """DCP's file system object, all of it but what a subclass does otherwise."""

    def __init__(self, fs: Any):
        self.fs = fs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


class _Recording(_Wrapped):
    """DCP's file system object, its write streams seen through files.recorder."""

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with self.fs.create_stream(path, mode) as stream:
                yield stream
            return
        with self.fs.create_stream(path, mode) as stream:
            recorder = files.recorder(stream)
            yield recorder
        with _lock:  # once closed: written whole (DCP closes it itself, inside the block)
            _written[os.fspath(path)] = recorder.written()

    def rename(self, path: Any, new_path: Any) -> None:  # DCP writes .metadata.tmp, then renames it
        self.fs.rename(path, new_path)
        with _lock:
            kept = _written.pop(os.fspath(path), None)
            if kept is not None:
                _written[os.fspath(new_path)] = kept


class ExactSlices:
    """Mixed into an fsspec DCP reader: each item read by one ranged GET of its bytes, nothing read ahead."""

    def _slice_file(self, file: Any, sinfo: Any) -> io.BytesIO:
        file.seek(sinfo.offset)
        return io.BytesIO(file.read(sinfo.length))

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fs = _NoReadAhead(self.fs)


class _NoReadAhead(_Wrapped):
    """DCP's file system object, its read streams opened without fsspec's read-ahead."""

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if mode != "rb":
            with self.fs.create_stream(path, mode) as stream:
                yield stream
            return
        with self.fs.fs.open(os.fspath(path), "rb", cache_type="none") as stream:  # the fsspec file system's
            yield stream

