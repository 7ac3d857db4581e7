"""Checkpoints in DESIGN's run folder, written so that a crash at any instant leaves the newest
complete one readable.

    checkpoints/step_<N>/model.pt        the unwrapped model state_dict alone
    checkpoints/step_<N>/state.pt        optimizer, schedule, scaler, position, RNG of every rank, recipe
    checkpoints/step_<N>/manifest.json   written last: each file's size and CRC-32; a folder without it is incomplete
    checkpoints/latest                   names the newest complete checkpoint
    model.pt                             the final model

A checkpoint is built in `.step_<N>.partial/`, every file fsynced, then the folder
renamed into place: a folder named step_<N> is always complete. The CRC-32 of each file is
computed as it is written and checked before a resume, so a damaged checkpoint (a flipped bit)
is passed over for the one before it. A checkpoint is data: nothing in it is run or resolved.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import json
import os
import pickle
import re
import shutil
import stat
import time
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar

import torch
import yaml
from torch.distributed.checkpoint import CheckpointException
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from launcher.errors import UserError, first_line

T = TypeVar("T")
PREFIXES = ("module.", "_orig_mod.")  # DataParallel / DDP, torch.compile
_STEP = re.compile(r"step_(\d+)")


class Checkpointer:
    """Saves (global rank 0 only: other ranks get `writer=False` and write nothing) and finds checkpoints."""

    def __init__(self, run_dir: Path, keep: int, writer: bool):
        self.run_dir = Path(run_dir)
        self.folder = self.run_dir / "checkpoints"
        self.keep = keep
        self.writer = writer

    def save(self, step: int, model_state: Dict[str, torch.Tensor], state: Dict[str, Any]) -> Optional[Path]:
        """A full-state checkpoint (model.pt and state.pt), written by rank 0 alone."""
        if not self.writer:
            return None
        partial = self.partial(step)

        def write() -> Path:
            self.prepare(partial)
            files = {"model.pt": self.write_model(partial / "model.pt", model_state),
                     "state.pt": _write(partial / "state.pt", lambda f: torch.save(state, f))}
            return self.seal(step, partial, files)

        return self.guarded(partial, write)

    def partial(self, step: int) -> Path:
        """Where the checkpoint of `step` is written before it is complete."""
        return self.folder / f".step_{step}.partial"

    def prepare(self, partial: Path) -> None:
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.mkdir(parents=True)
        except OSError as e:
            raise cannot_write(self.folder, e) from None

    def guarded(self, partial: Path, write: Callable[[], T]) -> T:
        """write(), or, when the disk refuses (full, read-only), the partial folder removed and one line:
        the complete checkpoints stay as they were."""
        try:
            return write()
        except (OSError, CheckpointException) as e:
            shutil.rmtree(partial, ignore_errors=True)
            raise cannot_write(self.folder, _os_error(e)) from None

    @staticmethod
    def write_model(path: Path, model_state: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        return _write(path, lambda f: torch.save(model_state, f))

    def seal(self, step: int, partial: Path, files: Dict[str, Any], **about: Any) -> Path:
        """Rank 0, once every file of the checkpoint is written: the manifest last, then the rename that
        makes it complete, `latest`, and the old ones removed."""
        final = self.folder / f"step_{step}"
        manifest = {"format": 3 if about.get("sharded") else 2, "step": step, **about, "files": files, "time": time.time()}
        _write(partial / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_dir(partial)
        if final.exists():  # a re-save of the same step (say, after a resume): replace it whole
            stale = self.folder / f".step_{step}.stale"
            shutil.rmtree(stale, ignore_errors=True)
            final.rename(stale)
            shutil.rmtree(stale)
        partial.rename(final)
        _fsync_dir(self.folder)
        write_text(self.folder / "latest", f"{final.name}\n")
        self._retain(final)
        return final

    def save_final(self, model_state: Dict[str, torch.Tensor]) -> Optional[Path]:
        if not self.writer:
            return None
        path = self.run_dir / "model.pt"
        try:
            _write(path, lambda f: torch.save(model_state, f), atomic=True)
        except OSError as e:
            raise cannot_write(path, e) from None
        return path

    def complete(self) -> List[Path]:
        """Complete checkpoints, oldest first."""
        return complete(self.folder)

    def _retain(self, written: Path) -> None:
        # The run folder holds one history (run_dir.py moves any other aside), so the highest steps
        # are the newest; the checkpoint just written is never deleted, whatever else is there.
        for old in self.complete()[:-self.keep]:
            if old != written:
                shutil.rmtree(old, ignore_errors=True)
        for leftover in self.folder.glob(".step_*"):  # partial saves of a crashed run
            shutil.rmtree(leftover, ignore_errors=True)


def step_folders(folder: Path) -> List[tuple[int, Path]]:
    """(step, folder) of every step_<N> folder, complete or not, by step."""
    if not folder.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.fullmatch(p.name)))


def step_of(folder: Path) -> int:
    m = _STEP.fullmatch(folder.name)
    return int(m.group(1)) if m else -1


def complete(folder: Path) -> List[Path]:
    """Complete checkpoints, oldest first."""
    return [p for _, p in step_folders(folder) if is_complete(p)]


def choose(folder: Path, resume: str) -> tuple[Optional[Path], List[str]]:
    """The checkpoint to resume from (None: start over) and lines to say: `auto` the newest complete
    one whose files match their checksums, `never` none, else the folder named, which must match."""
    if resume == "never":
        return None, []
    if resume == "auto":
        notes = []
        for candidate in reversed(complete(folder)):
            problem = verify(candidate)
            if problem is None:
                return candidate, notes
            notes.append(f"{candidate} is damaged ({problem}); resuming from the checkpoint before it")
        return None, notes
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"checkpoint.resume: {path} is not a checkpoint folder; use auto, never, "
                        f"or a folder such as {folder}/step_<N>")
    if not is_complete(path):
        raise UserError(f"checkpoint.resume: {path} is incomplete (no valid manifest.json); "
                        f"pick another folder, or resume=auto for the newest complete one")
    problem = verify(path)
    if problem is not None:
        raise UserError(f"checkpoint.resume: {path} is damaged ({problem}); pick another folder, or "
                        f"resume=auto for the newest undamaged one")
    return path, []


def _os_error(e: BaseException) -> OSError:
    """The OSError behind DCP's CheckpointException (it gathers every rank's failures), or a stand-in."""
    if isinstance(e, OSError):
        return e
    for failure in getattr(e, "failures", {}).values():
        cause = failure if isinstance(failure, BaseException) else getattr(failure, "exc", None)
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            return cause
    return OSError(first_line(e))


def cannot_write(where: Path, e: OSError) -> UserError:
    return UserError(f"cannot write {where}: {e.strerror or e} (errno {e.errno}); the newest complete checkpoint "
                     f"is kept. HINT: free some space, or point run_dir=... at a writable folder")


def is_complete(folder: Path) -> bool:
    """The manifest is there and lists the checkpoint's files: it is written last, so the save finished
    (whether its files are still as written is verify()'s question)."""
    return _manifest(folder) is not None


def _manifest(folder: Path) -> Optional[Dict[str, Any]]:
    """The files a checkpoint's manifest lists, {name: entry}, or None where it has no readable one."""
    try:
        files = json.loads((folder / "manifest.json").read_text())["files"]
        return files if isinstance(files, dict) and all(isinstance(e, (int, dict)) and "size" in _entry(e)
                                                        for e in files.values()) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _entry(entry: Any) -> Dict[str, Any]:
    return {"size": entry} if isinstance(entry, int) else entry  # format 1 manifests listed sizes alone


def verify(folder: Path) -> Optional[str]:
    """What is wrong with a complete checkpoint's files (a file missing, of another size or with another
    CRC-32 than the manifest lists), naming the file, or None. Checkpoints written before checksums were recorded pass on their sizes alone."""
    for name, entry in (_manifest(folder) or {}).items():
        try:
            size = (folder / name).stat().st_size
        except OSError as e:
            return f"{name}: {e.strerror or e}, the manifest lists it"
        if size != _entry(entry)["size"]:
            return f"{name}: {size} bytes, the manifest says {_entry(entry)['size']}"
        problem = _crc_problem(folder / name, entry)
        if problem:
            return problem
    return None


def _crc_problem(path: Path, entry: Any) -> Optional[str]:
    """How the file's CRC-32 differs from its manifest entry's, or None (also for an entry without one)."""
    want = _entry(entry).get("crc32")
    got = crc32(path) if want is not None else want
    return None if got == want else f"{path.name}: CRC-32 {got}, the manifest says {want}"


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def file_or_folder(path: Path) -> None:
    """Refuse what is neither a regular file nor a folder (a device, a FIFO, a socket): reading /dev/zero
    as a checkpoint would never end, and a FIFO would block."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return  # missing or unreadable: the read that follows says so
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise UserError(f"{path}: is {kind}, not a file or a folder; name a state_dict file, a checkpoint "
                        f"folder or a run folder")


def load_file(path: Path, map_location: Any = "cpu") -> Any:
    """torch.load with weights_only=True: a file that needs arbitrary unpickling is refused, never run."""
    file_or_folder(path)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr: one line is ours
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a folder; name the model.pt file inside it") from None
    except pickle.UnpicklingError as e:
        if not _pickled(path):
            raise UserError(f"{path}: not a checkpoint: neither torch's zip format nor a pickle") from None
        if "Unsupported global" in str(e) or not zipfile.is_zipfile(path):
            raise UserError(f"{path}: cannot load it as a checkpoint with weights_only=True: it holds objects other "
                            f"than tensors and plain containers, which could run code when loaded; it is not loaded") from None
        raise UserError(f"{path}: cannot load it as a checkpoint with weights_only=True: damaged "
                        f"({first_line(e)[:120]})") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ... for truncated or foreign files
        raise UserError(f"{path}: cannot load it as a checkpoint with weights_only=True: truncated or not a "
                        f"torch file ({first_line(e)[:120]})") from None


def _pickled(path: Path) -> bool:
    """torch's zip format, or a pickle (protocol 2 or later opens with PROTO)."""
    with open(path, "rb") as f:
        head = f.read(2)
    return zipfile.is_zipfile(path) or (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


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


# The run state's fields and what each must be; anything else in state.pt is refused.
STATE_FIELDS = {"position": dict, "optimizer": dict, "lr_schedule": (dict, type(None)), "scaler": dict,
                "rng": list, "recipe": str, "world_size": int, "stream": (list, type(None))}
POSITION_FIELDS = ("step", "epoch", "batch")


def load_state(path: Path, map_location: Any = "cpu") -> Dict[str, Any]:
    """A checkpoint's state.pt, checked field by field before anything uses it: a file of another
    structure is one line, never a KeyError or TypeError further on."""
    return state_problem_checked(load_file(path, map_location), path, optimizer=True)


def state_problem_checked(state: Any, where: Any, optimizer: bool = False) -> Dict[str, Any]:
    """The run state, once checked field by field (with the optimizer's, as state.pt holds it; a sharded
    checkpoint keeps the optimizer's in its shards)."""
    problem = _state_problem(state, optimizer)
    if problem:
        raise UserError(f"{where}: not a run state of this launcher: {problem}")
    return state


def _state_problem(state: Any, optimizer: bool) -> Optional[str]:
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a mapping"
    fields = {k: v for k, v in STATE_FIELDS.items() if optimizer or k != "optimizer"}
    missing = [k for k in fields if k not in state and k not in ("world_size", "stream")]
    extra = [k for k in state if k not in fields]
    if missing or extra:
        return f"missing {', '.join(missing)}" if missing else f"unknown field {extra[0]!r}"
    for key, kind in fields.items():
        if key in state and (not isinstance(state[key], kind) or isinstance(state[key], bool)):
            return f"{key} is a {type(state[key]).__name__}"
    position = state["position"]
    if sorted(position) != sorted(POSITION_FIELDS) or not all(
            type(position[k]) is int and position[k] >= 0 for k in POSITION_FIELDS):
        return f"position must hold {', '.join(POSITION_FIELDS)} as counts, got {position!r:.80}"
    if optimizer and (not isinstance(state["optimizer"].get("state"), dict)
                      or not isinstance(state["optimizer"].get("param_groups"), list)):
        return "optimizer is not an optimizer's state_dict (state, param_groups)"
    if not state["rng"] or not all(isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) for r in state["rng"]):
        return "rng must list each rank's generator states"
    return None


def saved_recipe(state: Dict[str, Any]) -> Dict[str, Any]:
    """The recipe a checkpoint was written with, as plain data: YAML read without OmegaConf, so an
    interpolation or resolver in it (`${oc.env:...}`) stays text and is never resolved."""
    try:
        data = yaml.load(state["recipe"], Loader=_NoAliases)
    except (yaml.YAMLError, RecursionError) as e:
        raise UserError(f"the checkpoint's recipe is not YAML: {first_line(e)}") from None
    if not isinstance(data, dict):
        raise UserError("the checkpoint's recipe is not a mapping of keys")
    return data


class _NoAliases(yaml.SafeLoader):
    """Plain YAML without anchors and aliases (a few aliases can expand into billions of nodes)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("aliases (*name) are not allowed in a saved recipe")
        return super().compose_node(parent, index)


# Where other tools nest a model's weights in their files (Lightning's .ckpt: state_dict).
NESTINGS = ("state_dict", "model", "model_state_dict", "module", "net")


def load_model_state(model: torch.nn.Module, path: Path, map_location: Any = "cpu", verified: bool = False) -> Optional[str]:
    """Load a state_dict file into the plain model with strict=True, naming the first difference if it
    does not fit. Weights nested under a key (a Lightning .ckpt's state_dict, {"model": ...}) load too,
    with a common prefix such as Lightning's `model.` removed when that makes them fit; the return
    value then says where they were found. A file in a checkpoint folder is first checked against the
    manifest's CRC-32 (unless `verified` says that was done)."""
    state, where = fitting_state(model.state_dict(), path, map_location, verified)
    model.load_state_dict(state, strict=True)
    return where


def fitting_state(expected: Dict[str, Any], path: Path, map_location: Any = "cpu",
                  verified: bool = False) -> tuple[Dict[str, torch.Tensor], Optional[str]]:
    """The weights of a state_dict file, found and checked against the model's `expected` keys and shapes
    as load_model_state says, and where in the file they were."""
    file_or_folder(path)
    if Path(path).is_dir():  # a checkpoint folder of either kind, or a run folder (checked as export checks them)
        from launcher.export import model_state

        weights, source = model_state(Path(path))
        state = {k: v.to(map_location) for k, v in weights.items()}
        where = f"its weights in {source}" if Path(source) != Path(path) else None  # a run folder's newest
    else:
        where = None
        if not verified:
            check_against_manifest(path)
        state = load_file(path, map_location)
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise UserError(f"{path}: not a model state_dict (a mapping of parameter names to tensors)")
    if not all(isinstance(v, torch.Tensor) for v in state.values()):
        key = next((k for k in NESTINGS if isinstance(state.get(k), dict) and state[k]
                    and all(isinstance(v, torch.Tensor) for v in state[k].values())), None)
        if key is None:
            keys = ", ".join(repr(k) for k in list(state)[:6])
            raise UserError(f"{path}: not a model state_dict: its keys ({keys}) hold more than tensors, and none "
                            f"of {', '.join(NESTINGS)} holds the weights")
        state, where = state[key], f"the weights under '{key}'"
    state = strip_prefixes(state)
    if state.keys() != expected.keys():
        heads = {k.split(".", 1)[0] for k in state}
        if len(heads) == 1 and all("." in k for k in state):
            head = heads.pop()
            stripped = {k[len(head) + 1:]: v for k, v in state.items()}
            if stripped.keys() == expected.keys():
                state = stripped
                where = f"{where or 'the weights'}, prefix '{head}.' removed"
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


def check_against_manifest(path: Path) -> None:
    """A file inside a checkpoint folder is checked against that folder's manifest before it is used."""
    manifest = path.parent / "manifest.json"
    if path.is_file() and manifest.is_file():
        try:
            entry = json.loads(manifest.read_text())["files"].get(path.name)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
        if entry is not None and _crc_problem(path, entry):
            raise UserError(f"{path}: damaged: its CRC-32 differs from the one {manifest} recorded; use another "
                            f"checkpoint's file")


def to_bytes(obj: Any) -> bytes:
    """An object of tensors and plain containers as torch.save's bytes (read back by load_bytes)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def load_bytes(data: Any) -> Any:
    """torch.load of bytes or a buffer with weights_only=True: a value that needs arbitrary unpickling is
    refused, never run."""
    buffer = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"a checkpoint value cannot be loaded with weights_only=True ({first_line(e)[:120]}); "
                        f"it is not loaded") from None


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


def write_file(path: Path, write: Callable[[Any], Any]) -> Dict[str, Any]:
    """A file written through write(file) atomically (a temporary name, fsync, rename); its size and CRC-32."""
    return _write(path, write, atomic=True)


def write_text(path: Path, text: str) -> None:
    """A small file replaced atomically (a temporary name, fsync, rename)."""
    _write(path, lambda f: f.write(text.encode()), atomic=True)


def _write(path: Path, write, atomic: bool = False) -> Dict[str, Any]:
    """Write through `write(file)`, fsync, and return the size and CRC-32 of what was written; with
    atomic, via a temporary name and rename."""
    target = path.with_name(f".{path.name}.tmp") if atomic else path
    with open(target, "wb") as f:
        recorder = _Recorder(f)
        try:
            write(recorder)
        except RuntimeError:  # torch's zip writer turns a failed write (a full disk) into a RuntimeError
            if recorder.error is not None:
                raise recorder.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    if atomic:
        os.replace(target, path)
        _fsync_dir(path.parent)
    return {"size": size, "crc32": f"{recorder.crc:08x}"}


class _Recorder:
    """A file that keeps the CRC-32 of what is written through it (torch.save writes it front to
    back), and remembers the OSError its write raised, for errors that torch re-raises as others.

    A large chunk's CRC-32 runs on a helper thread while this one writes it (both release the GIL):
    a checkpoint's save then takes about as long as without the check."""

    PARALLEL = 1 << 20  # bytes: below this a thread costs more than it saves

    def __init__(self, f):
        self.f, self.error, self.crc = f, None, 0

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
        return written

    def __getattr__(self, name):
        return getattr(self.f, name)


@functools.lru_cache(maxsize=1)
def _crc_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher-crc32")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
