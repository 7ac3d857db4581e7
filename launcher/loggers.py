"""What a run shows: TensorBoard event files and the console, on global rank 0 only.

Other ranks get the null objects, so the loop never asks which rank it is on.
tensorboard and tqdm are imported only when they are used.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Optional


class NullLogger:
    def scalars(self, values: Dict[str, float], step: int) -> None: ...
    def text(self, tag: str, text: str) -> None: ...
    def hparams(self, params: Dict[str, object], metrics: list) -> None: ...
    def close(self) -> None: ...


class TensorBoard(NullLogger):
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def scalars(self, values: Dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, text: str) -> None:
        self.writer.add_text(tag, text)

    def hparams(self, params: Dict[str, object], metrics: list) -> None:
        # Into this run's own event file: SummaryWriter.add_hparams would start a separate run folder.
        from torch.utils.tensorboard.summary import hparams

        experiment, start, end = hparams(params, {m: None for m in metrics})
        for summary in (experiment, start, end):
            self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        self.writer.close()


class Console:
    """Rank 0's messages: a tqdm bar on a terminal, otherwise one compact line per log interval."""

    def __init__(self, bar: bool):
        self.bar = None
        self.use_bar = bar and sys.stderr.isatty()

    def start(self, total: int, initial: int) -> None:
        if self.use_bar:
            from tqdm import tqdm

            # A terminal that reports no size (a fresh pseudo-terminal) would hide tqdm's bar.
            size = os.get_terminal_size(sys.stderr.fileno())
            self.bar = tqdm(total=total, initial=initial, unit="step", ncols=size.columns or 100, nrows=size.lines or 24)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def progress(self, step: int, total: int, epoch: int, values: Dict[str, float]) -> None:
        line = format_values(values)
        if self.bar is not None:
            self.bar.set_postfix_str(line, refresh=False)
        else:
            self.info(f"step {step}/{total} | epoch {epoch} | {line}")

    def info(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NullConsole(Console):
    def __init__(self):
        super().__init__(bar=False)

    def start(self, total: int, initial: int) -> None: ...
    def advance(self) -> None: ...
    def progress(self, step, total, epoch, values) -> None: ...
    def info(self, message: str) -> None: ...


def format_values(values: Dict[str, float]) -> str:
    parts = []
    for tag, value in values.items():
        name = tag.split("/", 1)[-1]
        if name.endswith("_per_s"):
            parts.append(f"{name.replace('_per_s', '')}/s {value:,.0f}")
        elif name == "mfu":
            parts.append(f"mfu {100 * value:.1f}%")
        elif name == "max_memory_gib":
            parts.append(f"max mem {value:.2f} GiB")
        elif name == "lr":
            parts.append(f"lr {value:.2e}")
        else:
            parts.append(f"{name} {value:.4f}")
    return " | ".join(parts)


def make(main: bool, run_dir: Path, tensorboard: bool, progress_bar: bool) -> tuple[NullLogger, Console]:
    if not main:
        return NullLogger(), NullConsole()
    logger: Optional[NullLogger] = TensorBoard(run_dir / "tensorboard") if tensorboard else NullLogger()
    return logger, Console(progress_bar)
