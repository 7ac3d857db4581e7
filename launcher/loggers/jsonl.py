"""`logging.jsonl`: files for scripts, with no dependency (as Lightning's CSVLogger writes metrics.csv
beside hparams.yaml):

    <run_dir>/metrics.jsonl   one JSON object per log step:
                              {"step": 50, "time": 1763820000.123, "train/loss": 2.31, "train/lr": 0.001, ...}
    <run_dir>/config.json     the resolved recipe, with `effective`: what actually runs (the strategy `auto`
                              chose, the world size, the device, the precision); rewritten at each start

Resumed, metrics.jsonl keeps the lines up to the checkpoint's step and the run appends from there, so
each step appears once. `time` is the Unix time the line was written.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict

from launcher.loggers import Start, writing

CONFIG = "config.json"


def backend(section, run_dir: Path):
    return Jsonl(run_dir / "metrics.jsonl")


class Jsonl:
    key = "jsonl"

    def __init__(self, path: Path):
        self.path = path
        self.file = None

    def start(self, run: Start) -> None:
        with writing(self.key, self.path):
            _replace(self.path.with_name(CONFIG), json.dumps(run.config, indent=1, default=str) + "\n")
            if run.step and self.path.exists():
                self._keep_through(run.step)
            self.file = open(self.path, "a" if run.step else "w", buffering=1)

    def _keep_through(self, step: int) -> None:
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    break  # a line cut by a kill: what follows it is not kept either
        _replace(self.path, "".join(kept))

    def scalars(self, values: Dict[str, float], step: int) -> None:
        with writing(self.key, self.path):
            self.file.write(json.dumps({"step": step, "time": round(time.time(), 3), **values}) + "\n")

    def reopen(self) -> str:
        """After a failed write: the file opened again (made again if it was deleted), appending."""
        old, self.file = self.file, None
        try:
            old.close()
        except OSError:
            pass
        with writing(self.key, self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", buffering=1)
        return f"appending to {self.path}"

    def close(self, status: str) -> None:
        if self.file is not None:
            with writing(self.key, self.path):
                self.file.close()


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
