"""The console of global rank 0: a tqdm bar on a terminal, otherwise one line per log interval.

Other ranks get NullConsole, so the loop never asks which rank it is on. tqdm is imported only when a
bar is shown.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List


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
            self.bar = tqdm(total=total, initial=initial, unit="step", ncols=size.columns or 100, nrows=size.lines or 24,
                            bar_format=BAR)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def progress(self, step: int, total: int, epoch: int, values: Dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_description_str(bar_values(values, self.bar.ncols), refresh=False)
        else:
            self.info(f"step {step}/{total} | epoch {epoch} | {format_values(values)}")

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
    return " | ".join(text for _, text in _parts(values))


def _parts(values: Dict[str, float]) -> List[tuple]:
    """(name, text) of each logged value, in the order logged. A value tagged one level deeper than its group's
    (`moe/load_max/layer_3`, one of many) goes to the loggers alone; the console shows the group's summary."""
    parts = []
    for tag, value in values.items():
        name = tag.split("/", 1)[-1]
        if "/" in name:
            continue
        if name.endswith("_per_s"):
            parts.append((name, f"{name.replace('_per_s', '')}/s {value:,.0f}"))
        elif name == "mfu":
            parts.append((name, f"mfu {100 * value:.1f}%"))
        elif name == "max_memory_gib":
            parts.append((name, f"max mem {value:.2f} GiB"))
        elif name == "lr":
            parts.append((name, f"lr {value:.2e}"))
        else:
            parts.append((name, f"{name} {value:.4f}"))
    return parts


# The values, then tqdm's own part (as torchtune's bar): "loss 0.6416 | accuracy 0.8859:  12%|██| 120/1000 [...]"
BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"
BAR_ITSELF = 52  # tqdm's part of a line with a short bar: ": 100%|███████| 1000/1000 [01:23<00:00, 12.34step/s]"
THE_REST = ("lr", "grad_norm", "mfu", "max_memory_gib")  # shown after the loss and the recipe's metrics


def bar_values(values: Dict[str, float], columns: int) -> str:
    """What the bar shows first (tqdm cuts a line too long for the terminal at its right end), for a
    terminal `columns` wide: the loss and the recipe's metrics always, then the learning rate, the
    gradient norm and the rates, each while the line still fits."""
    def rank(name: str) -> int:
        return 0 if name == "loss" else 2 if name in THE_REST or name.endswith("_per_s") else 1

    width, shown = columns - BAR_ITSELF, []
    for name, text in sorted(_parts(values), key=lambda part: rank(part[0])):  # stable: logged order within a rank
        if rank(name) < 2 or len(" | ".join([*shown, text])) <= width:
            shown.append(text)
    return " | ".join(shown)
