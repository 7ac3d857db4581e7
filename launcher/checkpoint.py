"""Checkpoints in DESIGN's run folder, written so that a crash at any instant leaves the newest
complete one readable.

    checkpoints/step_<N>/model.pt        the unwrapped model state_dict alone
    checkpoints/step_<N>/state.pt        optimizer, schedule, scaler, position, RNG of every rank, recipe
    checkpoints/step_<N>/manifest.json   written last: a folder without it is incomplete
    checkpoints/latest                   names the newest complete checkpoint
    model.pt                             the final model

A checkpoint is built in `.step_<N>.partial/`, every file fsynced, then the folder
renamed into place: a folder named step_<N> is always complete.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from launcher.errors import UserError, first_line

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
        if not self.writer:
            return None
        partial = self.folder / f".step_{step}.partial"
        try:
            return self._save(step, partial, model_state, state)
        except OSError as e:
            shutil.rmtree(partial, ignore_errors=True)  # the complete checkpoints stay as they were
            raise cannot_write(self.folder, e) from None

    def _save(self, step: int, partial: Path, model_state: Dict[str, torch.Tensor], state: Dict[str, Any]) -> Path:
        final = self.folder / f"step_{step}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        files = {}
        for name, obj in (("model.pt", model_state), ("state.pt", state)):
            files[name] = _write(partial / name, lambda f, obj=obj: torch.save(obj, f))
        manifest = {"step": step, "files": files, "time": time.time()}
        _write(partial / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_dir(partial)
        if final.exists():  # a re-save of the same step (say, after a resume): replace it whole
            stale = self.folder / f".step_{step}.stale"
            shutil.rmtree(stale, ignore_errors=True)
            final.rename(stale)
            shutil.rmtree(stale)
        partial.rename(final)
        _fsync_dir(self.folder)
        _write(self.folder / "latest", lambda f: f.write(f"{final.name}\n".encode()), atomic=True)
        self._retain()
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
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir()
                 if (m := _STEP.fullmatch(p.name)) and is_complete(p)]
        return [p for _, p in sorted(found)]

    def _retain(self) -> None:
        done = self.complete()
        for old in done[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in self.folder.glob(".step_*"):  # partial saves of a crashed run
            shutil.rmtree(leftover, ignore_errors=True)

    def resume_from(self, resume: str) -> Optional[Path]:
        """The checkpoint folder to resume from: `auto` the newest complete one (or none), `never` none, else a path."""
        if resume == "never":
            return None
        if resume == "auto":
            done = self.complete()
            return done[-1] if done else None
        path = Path(resume)
        if not path.is_dir():
            raise UserError(f"checkpoint.resume: {path} is not a checkpoint folder; use auto, never, "
                            f"or a folder such as {self.folder}/step_<N>")
        if not is_complete(path):
            raise UserError(f"checkpoint.resume: {path} is incomplete (no valid manifest.json); "
                            f"pick another folder, or resume=auto for the newest complete one")
        return path


def cannot_write(where: Path, e: OSError) -> UserError:
    return UserError(f"cannot write {where}: {e.strerror or e} (errno {e.errno}); the newest complete checkpoint "
                     f"is kept. HINT: free some space, or point run_dir=... at a writable folder")


def is_complete(folder: Path) -> bool:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        return all((folder / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def load_file(path: Path, map_location: Any = "cpu") -> Any:
    """torch.load with weights_only=True: a file that needs arbitrary unpickling is refused, never run."""
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr: one line is ours
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a folder; name the model.pt file inside it") from None
    except pickle.UnpicklingError:
        raise UserError(f"{path}: cannot load it as a checkpoint with weights_only=True: it holds objects other "
                        f"than tensors and plain containers, which could run code when loaded; it is not loaded") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ... for truncated or foreign files
        raise UserError(f"{path}: cannot load it as a checkpoint with weights_only=True: truncated or not a "
                        f"torch file ({first_line(e)[:120]})") from None


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


def load_model_state(model: torch.nn.Module, path: Path, map_location: Any = "cpu") -> None:
    """Load a state_dict file into the plain model with strict=True, naming the first difference if it does not fit."""
    state = load_file(path, map_location)
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise UserError(f"{path}: not a model state_dict (a mapping of parameter names to tensors)")
    state = strip_prefixes(state)
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key not in state:
            raise UserError(f"{path}: does not fit this model: '{key}' is missing from the file")
        got = state[key]
        if not isinstance(got, torch.Tensor) or got.shape != tensor.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise UserError(f"{path}: does not fit this model: '{key}' is {shape} in the file, "
                            f"{tuple(tensor.shape)} in the model")
    extra = [k for k in state if k not in expected]
    if extra:
        raise UserError(f"{path}: does not fit this model: the file has '{extra[0]}', which the model lacks")
    model.load_state_dict(state, strict=True)


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


def _write(path: Path, write, atomic: bool = False) -> int:
    """Write through `write(file)`, fsync, and return the size; with atomic, via a temporary name and rename."""
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
    return size


class _Recorder:
    """A file that remembers the OSError its write raised, for errors that torch re-raises as others."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name):
        return getattr(self.f, name)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
