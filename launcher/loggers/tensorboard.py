"""`logging.tensorboard`: event files in <run_dir>/tensorboard through torch's SummaryWriter."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Dict, Iterator

from launcher.loggers import Start, writing


def backend(section, run_dir: Path):
    return TensorBoard(run_dir / "tensorboard")


class TensorBoard:
    key = "tensorboard"

    def __init__(self, folder: Path):
        self.folder = folder
        self.writer = None

    def start(self, run: Start) -> None:
        with writing(self.key, self.folder), _without_s3():
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

            _quiet_writer_thread()
            _after_the_last_file(self.folder)
            # Resumed: TensorBoard hides what earlier event files hold from the next step on, which
            # this run logs again (a run killed after its checkpoint would otherwise show those twice).
            self.writer = SummaryWriter(log_dir=str(self.folder), purge_step=run.step + 1 if run.step else None)
            self.writer.add_text("recipe", "    " + run.recipe_yaml.replace("\n", "\n    "), run.step)
            ran = "\n".join(f"    {k}: {v}" for k, v in run.config.get("effective", {}).items())
            self.writer.add_text("effective", ran, run.step)  # what ran: the strategy auto chose, the world size, ...
            # Into this run's own event file: SummaryWriter.add_hparams would start a separate run folder.
            for summary in hparams(run.hparams, {m: None for m in run.metrics}):
                self.writer.file_writer.add_summary(summary)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        with writing(self.key, self.folder):
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def reopen(self) -> str:
        """After a failed write (its folder deleted): the folder made again and a new event file started
        in it, which TensorBoard reads with the others."""
        from torch.utils.tensorboard import SummaryWriter

        old, self.writer = self.writer, None
        try:
            old.close()  # raises the write that failed again
        except OSError:
            pass
        with writing(self.key, self.folder):
            self.folder.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(self.folder))
        return f"a new event file in {self.folder}"

    def close(self, status: str) -> None:
        if self.writer is not None:
            with writing(self.key, self.folder):
                self.writer.close()


def _after_the_last_file(folder: Path) -> None:
    """TensorBoard reads a folder's event files in the order of their names, `events.out.tfevents.<second>.
    <host>.<pid>.<count>`, and the count is not padded: a run started again within the second its last file
    was started (a resume in the same process) could sort before it (.10 < .9), and its purge of the steps
    it logs again would come first. Start in a later second than every file there."""
    seconds = [int(p.name.split(".")[3]) for p in folder.glob("events.out.tfevents.*")
               if p.name.split(".")[3:4] and p.name.split(".")[3].isdigit()]
    while seconds and time.time() < max(seconds) + 1:
        time.sleep(max(seconds) + 1 - time.time())


@contextlib.contextmanager
def _without_s3() -> Iterator[None]:
    """tensorboard's file layer imports boto3, where installed, to write to s3:// paths (160 ms, two thirds of
    tensorboard's import); the run folder is a local path, so that import is left out, for this import alone."""
    if "boto3" in sys.modules:
        yield
        return
    sys.modules["boto3"] = None  # `import boto3` raises ImportError: tensorboard then goes without S3
    try:
        yield
    finally:
        if "boto3" in sys.modules and sys.modules["boto3"] is None:
            del sys.modules["boto3"]


def _quiet_writer_thread() -> None:
    """tensorboard writes on a thread of its own; a write that fails there is kept for the next add_*,
    flush or close, which report it as one line, and then re-raised on the thread, whose traceback
    would be a second, noisy copy of the same error: leave that one out (it is global: once)."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "launcher_quiet", False):
        return

    def hook(args) -> None:
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    hook.launcher_quiet = True
    threading.excepthook = hook
