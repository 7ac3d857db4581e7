"""The checkpoints folder of a run: one history, written so that a crash at any instant leaves the newest
complete checkpoint readable.

    checkpoints/step_<N>/          a complete checkpoint: its files, then manifest.json (written last)
    checkpoints/.step_<N>.partial/ one being written; renamed to step_<N> once its manifest is in
    checkpoints/latest             names the newest complete checkpoint

In an object store (checkpoint.dir=s3://..., storage.py), which has no rename, a checkpoint is written
where it stays, step_<N>/, and is complete once its manifest, written last, is there: a step_<N> without
one is partial, ignored by resume and deleted by the next save; no `latest` (the newest complete one is
the highest step whose manifest checks out).

Only this file names, seals, chooses, keeps and removes step folders, and writes `latest`."""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from launcher.checkpoint import files, manifest, prefix_lock, storage
from launcher.errors import UserError, first_line

_STEP = re.compile(r"step_(\d+)")


def folder_of(run_dir: Path, configured: Optional[str]) -> Path:
    """The checkpoints folder: checkpoint.dir (a folder or a URL), else <run_dir>/checkpoints."""
    return storage.location(configured, key="checkpoint.dir") if configured else Path(run_dir) / "checkpoints"


def of_run(run_dir: Path) -> Path:
    """A run folder's checkpoints folder: the checkpoint.dir its recipe.yaml names (another folder, a URL),
    else <run_dir>/checkpoints."""
    import yaml

    try:
        configured = (yaml.safe_load((Path(run_dir) / "recipe.yaml").read_text()) or {})["checkpoint"]["dir"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        configured = None
    return folder_of(run_dir, configured if isinstance(configured, str) else None)


def steps(folder: Path) -> List[tuple[int, Path]]:
    """(step, folder) of every step_<N> folder, complete or not, by step."""
    if not folder.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.fullmatch(p.name)))


def step_of(folder: Path) -> int:
    m = _STEP.fullmatch(storage.location(folder).name)
    return int(m.group(1)) if m else -1


def complete(folder: Path) -> List[Path]:
    """Complete checkpoints, oldest first."""
    return [p for _, p in steps(folder) if manifest.is_complete(p)]


def choose(folder: Path, resume: str) -> tuple[Optional[Path], List[str]]:
    """The checkpoint to resume from (None: start over) and lines to say: `auto` the newest complete
    one whose files match their checksums, `never` none, else the folder named, which must match."""
    if resume == "never":
        return None, []
    if resume == "auto":
        notes = []
        for candidate in reversed(complete(folder)):
            problem = manifest.verify(candidate)
            if problem is None:
                return candidate, notes
            notes.append(f"{candidate} is damaged ({problem}); resuming from the checkpoint before it")
        return None, notes
    path = storage.location(resume)
    if not path.is_dir():
        raise UserError(f"checkpoint.resume: {path} is not a checkpoint folder; use auto, never, "
                        f"or a folder such as {folder}/step_<N>")
    if not manifest.is_complete(path):
        raise UserError(f"checkpoint.resume: {path} is incomplete (no valid manifest.json); "
                        f"pick another folder, or resume=auto for the newest complete one")
    problem = manifest.verify(path)
    if problem is not None:
        raise UserError(f"checkpoint.resume: {path} is damaged ({problem}); pick another folder, or "
                        f"resume=auto for the newest undamaged one")
    return path, []


def settle(folder: Path, found: Path) -> None:
    """`latest` names `found` again (a run continues from it after newer ones were moved aside). An object
    store has none."""
    if storage.is_remote(folder):
        return
    files.write_text(folder / "latest", f"{found.name}\n")


def partial(folder: Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is complete (in an object store: where it stays)."""
    if storage.is_remote(folder):
        return folder / f"step_{step}"
    return folder / f".step_{step}.partial"


def prepare(folder: Path, step: int) -> Path:
    """An empty partial folder for the checkpoint of `step` (in an object store, a re-save of the same step
    first loses the old one's manifest, so that it never counts as complete while half replaced)."""
    where = partial(folder, step)
    if storage.is_remote(folder):
        prefix_lock.check(folder)  # another run took the prefix over: nothing written over its checkpoints
        try:
            _remove(where)
        except Exception as e:  # noqa: BLE001 - the store gone, refusing, timing out: a failed save, not a crash
            cause = storage.store_error(e)
            if cause is None:
                raise
            raise files.cannot_write(folder, cause) from None
        return where
    shutil.rmtree(where, ignore_errors=True)
    try:
        where.mkdir(parents=True)
    except OSError as e:
        raise files.cannot_write(folder, e) from None
    return where


@contextlib.contextmanager
def guarding(folder: Path, step: int) -> Iterator[None]:
    """Where the disk refuses a write (full, read-only), the partial folder removed and one line: the
    complete checkpoints stay as they were. In an object store a step whose manifest is in stays: its request
    failed after the store had written it (the answer lost), and the checkpoint is sealed (Checkpoints.failed
    reads the store again to say so)."""
    try:
        yield
    except BaseException as e:  # OSError, or DCP's CheckpointException (a BaseException) gathering every rank's failures
        cause = _os_error(e)
        if cause is None:
            raise
        written = partial(folder, step)
        try:
            if not (storage.is_remote(folder) and manifest.is_complete(written)):
                _remove(written)
        except Exception as gone:  # noqa: BLE001 - a store that refuses the write may refuse this too:
            if _os_error(gone) is None:  # the next save deletes the partial one
                raise
        raise files.cannot_write(folder, cause) from None


def _os_error(e: BaseException) -> Optional[OSError]:
    """The OSError behind an error (an object store's failure stands as one; DCP's CheckpointException
    gathers every rank's failures): None when it is neither, a stand-in for a CheckpointException without one."""
    if storage.store_error(e) is not None:
        return storage.store_error(e)
    failures = getattr(e, "failures", None)
    if type(e).__name__ != "CheckpointException" or not isinstance(failures, dict):
        return None
    for failure in failures.values():
        # torch 2.13 wraps each rank's as (exception, traceback summary)
        cause = failure if isinstance(failure, BaseException) else (
            failure[0] if isinstance(failure, tuple) and failure else getattr(failure, "exc", None))
        while cause is not None and storage.store_error(cause) is None:
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            return storage.store_error(cause)
    return OSError(first_line(e))


def seal(folder: Path, step: int, listed: Dict[str, Any], keep: int, **about: Any) -> Path:
    """Once every file of the checkpoint of `step` is written: the manifest last, then the rename that
    makes it complete, `latest`, and the old ones removed (all but the newest `keep`). In an object store
    the manifest alone makes it complete."""
    if storage.is_remote(folder):
        written = partial(folder, step)
        manifest.write(written, step, listed, **about)
        _retain(folder, written, keep)
        return written
    written, final = partial(folder, step), folder / f"step_{step}"
    manifest.write(written, step, listed, **about)
    files.fsync_dir(written)
    if final.exists():  # a re-save of the same step (say, after a resume): replace it whole
        stale = folder / f".step_{step}.stale"
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        shutil.rmtree(stale)
    written.rename(final)
    files.fsync_dir(folder)
    settle(folder, final)
    _retain(folder, final, keep)
    return final


def _retain(folder: Path, written: Path, keep: int) -> None:
    """The old checkpoints removed once `written` is sealed; a store that fails now leaves them to the next
    save's retention (the save itself is complete)."""
    try:
        _retained(folder, written, keep)
    except Exception as e:  # noqa: BLE001 - boto's and fsspec's errors, told apart by storage.store_error
        if not storage.is_remote(folder) or storage.store_error(e) is None:
            raise


def _retained(folder: Path, written: Path, keep: int) -> None:
    # The run folder holds one history (run_dir.py moves any other aside), so the highest steps are the
    # newest; the checkpoint just written is never deleted, whatever else is there.
    for old in complete(folder)[:-keep]:
        if old != written:
            _remove(old)
    if storage.is_remote(folder):  # step_<N> without a manifest: partial saves of a crashed run
        leftovers = [p for _, p in steps(folder) if p != written and not manifest.is_complete(p)]
    else:
        leftovers = list(folder.glob(".step_*"))
    for leftover in leftovers:
        _remove(leftover)


def _remove(checkpoint: Path) -> None:
    """A checkpoint deleted: in an object store its manifest first, so that one deleted halfway is partial,
    never complete and damaged."""
    if storage.is_remote(checkpoint):
        (checkpoint / manifest.NAME).remove()
    storage.removed(checkpoint)
