"""Where a run's numbers go: any number of backends at once, on global rank 0 only.

Each backend is one file of this package and one field of `logging:` (LoggingConfig), and has

    start(run: Start) -> Optional[dict]     open (or continue) its run; what it returns is kept in
                                            <run_dir>/trackers.json and handed back as run.kept on resume
    scalars(values: {tag: float}, step)     one call per log step (train and validation values together)
    close(status) -> Optional[dict]         "finished" | "stopped" (a signal: the run will go on) | "failed";
                                            what it returns replaces what start returned

`Loggers` fans out to them. Other ranks get an empty `Loggers`, so the loop never asks which rank it
is on. A backend's package is imported only when the recipe asks for it; a missing one is a user
mistake naming the pip command.

Resume: TensorBoard purges what followed the checkpoint (purge_step) and metrics.jsonl drops those
lines, so each re-logs from the checkpoint on. A tracker (MLflow, W&B) continues the same run, whose
id trackers.json keeps, and skips each value its run already holds: training resumes exactly, so the
values it would send again are the ones it has. What a run holds is what the tracker itself says
(MLflow's store; W&B's run after a finish, which flushes it), never what was merely handed to it: a
run killed with values still in flight sends them again rather than lose them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from launcher.errors import UserError, first_line
from launcher.loggers.console import Console, NullConsole, bar_values, format_values  # noqa: F401

RECORD = "trackers.json"  # the tracker runs this run continues
STATUSES = ("finished", "stopped", "failed")


@dataclass
class Start:
    run_dir: Path
    name: str  # the recipe's name: the default experiment, project and run name
    step: int  # 0 for a new run; else the step of the checkpoint it continues from
    recipe_yaml: str
    config: Dict[str, Any]  # the resolved recipe, nested, with `effective` (what actually runs) added
    hparams: Dict[str, Any]  # the same, flat: `dotted.key: scalar`
    metrics: List[str]  # tags that summarise a run (TensorBoard's hparams view)
    say: Callable[[str], None] = print  # a line on the console
    kept: Dict[str, Any] = field(default_factory=dict)  # what this backend returned at the last start or close


class Loggers:
    """The backends of global rank 0 (none elsewhere), and the record that lets a tracker continue."""

    def __init__(self, backends: List[Any], run_dir: Optional[Path] = None):
        self.backends, self.run_dir = backends, run_dir
        self.kept: Dict[str, Any] = {}
        self.closed = False
        self.say: Callable[[str], None] = print
        # Only trackers continue a run elsewhere; TensorBoard and jsonl rewrite their own files.
        self.tracking = any(getattr(b, "continues", False) for b in backends)

    def start(self, run: Start) -> None:
        self.say = run.say
        record = self._read() if run.step > 0 and self.backends else {}
        for backend in self.backends:
            run.kept = record.get(backend.key, {})
            kept = backend.start(run)
            if kept:
                self.kept[backend.key] = kept
        if self.tracking:
            self._write()

    def scalars(self, values: Dict[str, float], step: int) -> None:
        for backend in list(self.backends):
            try:
                backend.scalars(values, step)
            except Exception as e:  # after the start: the backend's loss, not the run's
                self._recover(backend, e, step, lambda: backend.scalars(values, step))

    def _recover(self, backend: Any, e: Exception, step: int, again: Callable[[], None]) -> None:
        """A backend that fails after the start (its folder deleted, a full disk, its server gone) is opened
        again where it can be (`reopen()`) and the values sent again; otherwise it is dropped, with one line
        naming the cause, and training goes on."""
        cause = _cause(backend, e)
        reopen = getattr(backend, "reopen", None)
        if reopen is not None:
            try:
                where = reopen()
                again()
                self.say(f"logging.{backend.key}: {cause}; opened it again at step {step} ({where})")
                return
            except Exception as again_failed:  # noqa: BLE001 - whatever it is, it is dropped
                cause = _cause(backend, again_failed)
        self.backends.remove(backend)
        with contextlib.suppress(Exception):
            backend.close("failed")
        self.say(f"logging.{backend.key}: {cause}; dropped at step {step}, training goes on without it")

    def close(self, status: str = "finished") -> None:
        if self.closed:
            return
        self.closed = True
        for backend in list(self.backends):
            try:
                kept = backend.close(status)
            except Exception as e:  # what it had not written is its loss; the model is written after this
                self.say(f"logging.{backend.key}: {_cause(backend, e)}; not closed cleanly")
                continue
            if kept:
                self.kept[backend.key] = kept
        if self.tracking:
            with contextlib.suppress(UserError):  # unwritten, the next start sends a little again: no loss
                self._write()

    def _read(self) -> Dict[str, Any]:
        path = self.run_dir / RECORD
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise UserError(f"logging: cannot read {path}, which names the tracker runs this run continues: {e}; "
                            f"delete it to start new tracker runs") from None

    def _write(self) -> None:
        path = self.run_dir / RECORD
        temporary = path.with_name(f".{RECORD}.tmp")
        try:
            temporary.write_text(json.dumps(self.kept))
            os.replace(temporary, path)
        except OSError as e:
            raise UserError(f"logging: cannot write {path}: {e.strerror or e} (errno {e.errno}). HINT: free some "
                            f"space, or point run_dir=... at a writable folder") from None


def _cause(backend: Any, e: Exception) -> str:
    """What went wrong, for a line that starts with the backend's key and says what happens next."""
    return first_line(e).removeprefix(f"logging.{backend.key}: ").split(". HINT:")[0]


@contextlib.contextmanager
def writing(section: str, path: Path) -> Iterator[None]:
    """A file backend's write that fails (a full disk, a read-only folder) is a user mistake naming the
    path and the errno, as a checkpoint's is."""
    try:
        yield
    except OSError as e:
        raise UserError(f"logging.{section}: cannot write {path}: {e.strerror or e} (errno {e.errno}). HINT: free "
                        f"some space, point run_dir=... at a writable folder, or set logging.{section}=false") from None


# The backends, by their field of `logging:` (LoggingConfig). Each is the module launcher.loggers.<name>,
# which has `backend(section, run_dir)` (section: the field's value) and, for an optional package,
# `PACKAGE = (import name, pip package)`; its extra is launcher[<name>]. A new backend: its file, its
# field, and its name here.
BACKENDS = ("tensorboard", "jsonl", "mlflow", "wandb")


def require(module: str, section: str, extra: str, package: str) -> None:
    """A missing optional package is a user mistake that names the command installing it."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise UserError(f"logging.{section}: the {package} package is not installed; pip install "
                        f"'launcher[{extra}]' (or pip install {package}), or set logging.{section}=null") from None


def make(main: bool, run_dir: Path, cfg) -> tuple[Loggers, Console]:
    """The loggers and console of this rank, from the recipe's `logging:` section."""
    if not main:
        return Loggers([]), NullConsole()
    backends: List[Any] = []
    for name in BACKENDS:
        section = getattr(cfg, name)
        if section is None or section is False:
            continue
        module = importlib.import_module(f"launcher.loggers.{name}")
        if getattr(module, "PACKAGE", None):
            require(module.PACKAGE[0], name, name, module.PACKAGE[1])
        backends.append(module.backend(section, run_dir))
    return Loggers(backends, run_dir), Console(cfg.progress_bar)
