"""Files of a checkpoint, byte by byte: written with fsync (atomically, by a temporary name and a rename,
where asked) and their CRC-32 computed as they are written; read with torch.load(weights_only=True), so
that nothing in a file is ever run."""

from __future__ import annotations

import concurrent.futures
import functools
import io
import os
import pickle
import stat
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Dict

import torch

from launcher.checkpoint import storage
from launcher.errors import UserError, first_line


def write(path: Path, fill: Callable[[Any], Any], atomic: bool = False) -> Dict[str, Any]:
    """Write through `fill(file)`, fsync, and return the size and CRC-32 of what was written; with
    atomic, via a temporary name and rename. An object in an object store is written whole or not at all
    by the store itself: there, neither applies."""
    if storage.is_remote(path):
        return _write_remote(path, fill)
    target = path.with_name(f".{path.name}.tmp") if atomic else path
    with open(target, "wb") as f:
        recorder = _filled(f, fill)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    if atomic:
        os.replace(target, path)
        fsync_dir(path.parent)
    return {"size": size, "crc32": f"{recorder.crc:08x}"}


def _write_remote(path: "storage.Remote", fill: Callable[[Any], Any]) -> Dict[str, Any]:
    with path.upload() as f:  # uploaded as it fills (in parts), complete when closed
        recorder = _filled(f, fill)
        size = f.tell()
    return {"size": size, "crc32": f"{recorder.crc:08x}"}


def _filled(f: Any, fill: Callable[[Any], Any]) -> "_Recorder":
    """`fill` written into `f` through a _Recorder, the OSError behind a failed write raised as itself."""
    recorder = _Recorder(f)
    try:
        fill(recorder)
    except RuntimeError:  # torch's zip writer turns a failed write (a full disk) into a RuntimeError
        if recorder.error is not None:
            raise recorder.error from None
        raise
    return recorder


def recorder(f: Any) -> _Recorder:
    """`f` seen through a file that keeps the size and CRC-32 of what is written through it."""
    return _Recorder(f)


def write_text(path: Path, text: str) -> None:
    """A small file replaced atomically (a temporary name, fsync, rename)."""
    write(path, lambda f: f.write(text.encode()), atomic=True)


def save(path: Path, obj: Any, atomic: bool = False) -> Dict[str, Any]:
    """torch.save of `obj` into `path` through write(): its size and CRC-32."""
    return write(path, lambda f: torch.save(obj, f), atomic)


class _Recorder:
    """A file that keeps the CRC-32 of what is written through it (torch.save writes it front to
    back), and remembers the OSError its write raised, for errors that torch re-raises as others.

    A large chunk's CRC-32 runs on a helper thread while this one writes it (both release the GIL):
    a checkpoint's save then takes about as long as without the check."""

    PARALLEL = 1 << 20  # bytes: below this a thread costs more than it saves

    def __init__(self, f):
        self.f, self.error, self.crc, self.size = f, None, 0, 0

    def write(self, data):
        view = memoryview(data).cast("B")
        pending = None
        if view.nbytes >= self.PARALLEL:
            pending = _crc_thread().submit(zlib.crc32, view, self.crc)
        try:
            written = self.f.write(view)
        except OSError as e:
            self.error = e
            raise
        finally:
            crc = pending.result() if pending is not None else None  # data is the caller's again after this
        if crc is None or written != view.nbytes:
            crc = zlib.crc32(view[:written] if written is not None else view, self.crc)
        self.crc = crc
        self.size += written if written is not None else view.nbytes
        return written

    def written(self) -> Dict[str, Any]:
        """The size and CRC-32 of what was written through it, as a manifest lists them."""
        return {"size": self.size, "crc32": f"{self.crc:08x}"}

    def __getattr__(self, name):
        return getattr(self.f, name)


@functools.lru_cache(maxsize=1)
def _crc_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher-crc32")


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_folder(out: Path, fill: Callable[[Path], Any], what: str) -> Any:
    """A new folder at `out` (absent, or empty), whole or absent: `fill(folder)` writes into a hidden folder
    beside it, which is then renamed. Returns what `fill` returns."""
    import shutil

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists and is not an empty folder; name a new folder for {what}")
    partial = out.with_name(f".{out.name}.partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    filled = fill(partial)
    if out.exists():
        out.rmdir()  # empty, checked above
    partial.rename(out)
    fsync_dir(out.parent)
    return filled


def crc32(path: Path) -> str:
    crc = 0
    with storage.location(path).open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def cannot_write(where: Path, e: OSError) -> UserError:
    if storage.is_remote(where):
        return UserError(f"cannot write {where}: {e.strerror or first_line(e)}; the newest complete checkpoint is "
                         f"kept. HINT: check the object store (AWS_ENDPOINT_URL, the bucket, its permissions)")
    return UserError(f"cannot write {where}: {e.strerror or e} (errno {e.errno}); the newest complete checkpoint "
                     f"is kept. HINT: free some space, or point run_dir=... at a writable folder")


def file_or_folder(path: Path) -> None:
    """Refuse what is neither a regular file nor a folder (a device, a FIFO, a socket): reading /dev/zero
    as a checkpoint would never end, and a FIFO would block."""
    if storage.is_remote(path):
        return  # an object store holds objects alone
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return  # missing or unreadable: the read that follows says so
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise UserError(f"{path}: is {kind}, not a file or a folder; name a state_dict file, a checkpoint "
                        f"folder or a run folder")


def load(path: Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """torch.load with weights_only=True: a file that needs arbitrary unpickling is refused, never run. With
    `mmap`, a file of torch's zip format is memory-mapped: a tensor's bytes are read where it is used."""
    path = storage.location(path)
    file_or_folder(path)
    try:
        if storage.is_remote(path):  # read whole into memory: torch.load seeks back and forth
            return _weights_only(io.BytesIO(path.download()), map_location)
        return _weights_only(path, map_location, mmap=mmap and zipfile.is_zipfile(path))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a folder; name the model.pt file inside it") from None
    except pickle.UnpicklingError as e:
        if not _pickled(path):
            raise UserError(f"{path}: not a checkpoint: neither torch's zip format nor a pickle") from None
        if "Unsupported global" in str(e) or not _zipped(path):
            raise UserError(f"{path}: cannot load it as a checkpoint with weights_only=True: it holds objects other "
                            f"than tensors and plain containers, which could run code when loaded; it is not loaded") from None
        raise UserError(f"{path}: cannot load it as a checkpoint with weights_only=True: damaged "
                        f"({first_line(e)[:120]})") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ... for truncated or foreign files
        raise UserError(f"{path}: cannot load it as a checkpoint with weights_only=True: truncated or not a "
                        f"torch file ({first_line(e)[:120]})") from None


def _weights_only(source: Any, map_location: Any, mmap: bool = False) -> Any:
    with warnings.catch_warnings():  # torch warns about pickle protocols on stderr: one line is ours
        warnings.simplefilter("ignore")
        return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)


def _pickled(path: Path) -> bool:
    """torch's zip format, or a pickle (protocol 2 or later opens with PROTO)."""
    with path.open("rb") as f:
        head = f.read(2)
        f.seek(0)
        zipped = zipfile.is_zipfile(f)
    return zipped or (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def _zipped(path: Path) -> bool:
    with path.open("rb") as f:
        return zipfile.is_zipfile(f)


def to_bytes(obj: Any) -> bytes:
    """An object of tensors and plain containers as torch.save's bytes (read back by load_bytes)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def load_bytes(data: Any) -> Any:
    """torch.load of bytes or a buffer with weights_only=True: a value that needs arbitrary unpickling is
    refused, never run."""
    try:
        return _weights_only(io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data, "cpu")
    except Exception as e:
        raise UserError(f"a checkpoint value cannot be loaded with weights_only=True ({first_line(e)[:120]}); "
                        f"it is not loaded") from None
