"""The run folder, owned by global rank 0: one run at a time, and one run's history in it.

- A lock (`<run_dir>/.lock`, a POSIX record lock) held for the whole run: a second run started on the same folder
  is refused with one line instead of interleaving its checkpoints with the first one's. A checkpoint.dir
  outside the run folder is locked too: a folder by its own `.lock`, an object store's prefix by a lock object
  (checkpoint/prefix_lock.py).
- A run that does not continue the history it finds (`checkpoint.resume=never`, a checkpoint from
  elsewhere, or an earlier checkpoint of this folder) moves what would be mixed with its own into
  `<run_dir>/replaced/<time>/`: nothing is deleted, and `checkpoints/` and `latest` only ever hold
  the running history. The Slurm logs stay where they are (a running job writes into them).
- Checkpoints kept elsewhere (checkpoint.dir: another folder, or an object store, where nothing can be
  moved aside cheaply) are not moved: a run that would mix its history with another's found there is
  refused with one line instead.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from launcher import checkpoint, folder_lock
from launcher.checkpoint import prefix_lock, storage
from launcher.errors import UserError

# What a run writes that belongs to its history (the recipe.yaml of the run that wrote them too).
ARTEFACTS = ("checkpoints", "model.pt", "tensorboard", "recipe.yaml", "metrics.jsonl", "config.json", "trackers.json", "wandb",
             "profile", "memory", "flight_recorder", "hf_config.json", "generation_config.json", "hf")
REPLACED = "replaced"


class RunFolder:
    def __init__(self, path: Path, checkpoints: Optional[str] = None):
        self.path = Path(path)
        self.own = self.path / "checkpoints"
        self.checkpoints = checkpoint.folder_of(self.path, checkpoints)
        self._lock: Optional[int] = None
        self._checkpoints_lock: Optional[int] = None  # checkpoint.dir's, a local folder outside the run folder
        self._prefix: Optional[prefix_lock.Lock] = None  # checkpoint.dir's, an object store's prefix

    def open(self, recipe_yaml: str, resume: str, init_from: Optional[str] = None) -> tuple:
        """Lock the folder, settle which checkpoint this run continues (None: it starts over), move
        aside what belongs to another history, and write the recipe. Returns the checkpoint, the
        lines to say about it, and where `init_from` is now (it may have been in what moved)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _unwritable(self.path, e) from None
        self.lock()
        said = _reachable({"checkpoint.dir": self.checkpoints, "checkpoint.resume": resume, "checkpoint.init_from": init_from})
        if not storage.is_remote(self.checkpoints) and self.checkpoints.exists() and not self.checkpoints.is_dir():
            raise UserError(f"run_dir: {self.checkpoints} is a file, where the run keeps its checkpoints folder; "
                            f"move it away, or point run_dir=... at another folder")
        said += self.lock_checkpoints()
        found, notes = checkpoint.choose(self.checkpoints, resume)
        notes = said + notes
        moved = self._set_aside(found)
        if moved:
            notes.append(moved[0])
        if init_from and not storage.is_url(init_from):
            init_from = str(_relocated(Path(init_from), moved[1:]))
        try:
            if not storage.is_remote(self.checkpoints):
                self.checkpoints.mkdir(parents=True, exist_ok=True)
            checkpoint.write_text(self.path / "recipe.yaml", recipe_yaml)
        except OSError as e:
            raise _unwritable(self.path, e) from None
        return found, notes, init_from

    def lock(self) -> None:
        try:
            self._lock = folder_lock.take(self.path)
        except OSError as e:
            raise _unwritable(self.path, e) from None

    def lock_checkpoints(self) -> list:
        """checkpoint.dir outside the run folder: its own lock, as the run folder's (a prefix's: an object,
        prefix_lock.py). Returns the line to say where a gone run's lock was taken over."""
        if storage.same(self.checkpoints, self.own):
            return []
        if storage.is_remote(self.checkpoints):
            self._prefix, said = prefix_lock.take(self.checkpoints, os.path.abspath(self.path))
            return [said] if said else []
        try:
            self.checkpoints.mkdir(parents=True, exist_ok=True)  # as the run folder's own would be
            self._checkpoints_lock = folder_lock.take(self.checkpoints, "checkpoint.dir")
        except OSError as e:
            raise UserError(f"checkpoint.dir: cannot write {self.checkpoints}: {e.strerror or e}; name a writable "
                            f"folder") from None
        return []

    def close(self) -> None:
        """Release the locks (the process's exit releases a folder's too, however it ends; a prefix's, left by a
        run that died, is taken over by the next: prefix_lock.py)."""
        for fd in (self._lock, self._checkpoints_lock):
            if fd is not None:
                os.close(fd)
        self._lock = self._checkpoints_lock = None
        if self._prefix is not None:
            self._prefix.release()
            self._prefix = None

    def _set_aside(self, found: Optional[Path]) -> list:
        """Move what is not this run's history into replaced/<time>/. Returns a line that says so,
        then (from, to) for each move; nothing if nothing moved."""
        continued = found is not None and storage.same(found.parent, self.checkpoints)
        if not storage.same(self.checkpoints, self.own):
            _one_history(self.checkpoints, found, continued)
            if continued:
                return []
        steps = checkpoint.steps(self.own)
        if continued:
            moving = [p for step, p in steps if step > checkpoint.step_of(found)]
            moving += [self.path / "model.pt"] if moving and (self.path / "model.pt").exists() else []
            why = f"the run continues from {found.name}"
        else:
            if not steps and not (self.path / "model.pt").exists():
                return []  # nothing of an earlier run's to keep apart
            moving = [self.path / name for name in ARTEFACTS if (self.path / name).exists()]
            why = "the run starts over" if found is None else f"the run continues from {found}"
        if not moving:
            return []
        target = self._replaced_folder()
        moves = []
        for p in moving:
            relative = p.relative_to(self.path)
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            p.rename(target / relative)
            moves.append((p, target / relative))
        if continued:
            checkpoint.settle(self.checkpoints, found)
        names = ", ".join(str(p.relative_to(self.path)) for p in moving)
        return [f"{why}: moved what an earlier run left in {self.path} ({names}) to {target}", *moves]

    def set_aside_model(self, step: int) -> Optional[str]:
        """A run that continues from step_<step> and will train past it: the model.pt an earlier run left
        (the weights where it ended, at that step or before) moves to replaced/<time>/, so that a model.pt
        in a run folder is never older than its newest checkpoint. A line saying so, or None."""
        model = self.path / "model.pt"
        if not model.exists():
            return None
        target = self._replaced_folder() / "model.pt"
        try:
            model.rename(target)
        except OSError as e:
            raise _unwritable(self.path, e) from None
        return (f"{model} holds the weights where an earlier run ended, at step {step} or before: moved to {target}; "
                f"this run writes its own at its end")

    def _replaced_folder(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target, n = self.path / REPLACED / stamp, 1
        while target.exists():
            n += 1
            target = self.path / REPLACED / f"{stamp}-{n}"
        target.mkdir(parents=True)
        return target


def _reachable(named: dict) -> list:
    """The object stores named (by URL) answer: a missing bucket or no credentials is one line, now. Returns
    the lines to say (s3:// through s3fs alone, once)."""
    said = []
    for key, where in named.items():
        place = storage.location(where, key=key) if where else None  # a file:// URL of another host: one line
        if where and storage.is_url(where):
            note = storage.reachable(place, key)
            said += [note] if note and note not in said else []
    return said[:1]


def _one_history(folder, found, continued: bool) -> None:
    """Checkpoints kept outside the run folder stay where they are: a run that would leave another
    history's checkpoints beside its own there (newer ones than it continues from, or those of a run it does
    not continue) is refused, saying which."""
    held = checkpoint.complete(folder)
    if continued:
        newer = [p for p in held if checkpoint.step_of(p) > checkpoint.step_of(found)]
        if newer:
            problem = checkpoint.verify(newer[-1])
            damaged = f" (damaged: {problem})" if problem else ""
            raise UserError(f"checkpoint.dir: {folder} holds {newer[-1].name}{damaged}, newer than {found.name} which "
                            f"this run continues from; checkpoints outside the run folder are not moved aside: delete "
                            f"{newer[-1]}, or name another checkpoint.dir")
    elif held:
        why = "starts over" if found is None else f"continues from {found}"
        raise UserError(f"checkpoint.dir: {folder} holds another run's checkpoints ({held[-1].name}) and this run "
                        f"{why}; checkpoints outside the run folder are not moved aside: name another "
                        f"checkpoint.dir, or delete them")


def _relocated(path: Path, moves: list) -> Path:
    """Where `path` is after `moves`, (from, to) pairs."""
    here = Path(os.path.abspath(path))
    for old, new in moves:
        old = Path(os.path.abspath(old))
        if here == old or old in here.parents:
            return Path(new) / here.relative_to(old)
    return path


def _unwritable(path: Path, e: OSError) -> UserError:
    return UserError(f"run_dir: cannot write {path}: {e.strerror or e}; point run_dir=... at a writable folder")
