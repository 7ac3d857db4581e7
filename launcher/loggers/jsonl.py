"""`logging.jsonl`: <run_dir>/metrics.jsonl, one JSON object per log step, for scripts (no dependency).

    {"step": 50, "time": 1763820000.123, "train/loss": 2.31, "train/lr": 0.001, ...}

Resumed, the file keeps the lines up to the checkpoint's step and the run appends from there, so
each step appears once. `time` is the Unix time the line was written.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict

from launcher.loggers import Start, writing


class Jsonl:
    key = "jsonl"

    def __init__(self, path: Path):
        self.path = path
        self.file = None

    def start(self, run: Start) -> None:
        with writing(self.key, self.path):
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
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text("".join(kept))
        os.replace(temporary, self.path)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        with writing(self.key, self.path):
            self.file.write(json.dumps({"step": step, "time": round(time.time(), 3), **values}) + "\n")

    def close(self, status: str) -> None:
        if self.file is not None:
            with writing(self.key, self.path):
                self.file.close()
