"""A sweep's folder: `sweep.json` (the recipe, the overrides every run takes, the grid and each run's name and
overrides), one run folder per combination beside it, and in each run folder `sweep-exit.json`, the exit code
its last process ended with (written by whoever ran it: the local queue, or the Slurm array task's script).

A run's status is read from what the run itself writes: the run folder's lock (held while it runs),
config.json (its total steps) and metrics.jsonl (its last logged step); the exit code only tells a failure
from a stop that resumes (a preemption, Ctrl-C)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher import folder_lock
from launcher.errors import UserError
from launcher.sweep.grid import Run

SWEEP = "sweep.json"
EXIT = "sweep-exit.json"


@dataclass
class Sweep:
    folder: Path
    recipe: str
    overrides: List[str]  # every run's
    axes: Dict[str, List[str]]
    runs: List[Run]
    trackers: List[str] = field(default_factory=list)  # the recipe's mlflow, wandb: each run named in them
    checkpoints: Optional[str] = None  # the recipe's checkpoint.dir (a folder, a URL): each run's below it

    def run_dir(self, run: Run) -> Path:
        return self.folder / run.name

    def arguments(self, run: Run) -> List[str]:
        """`python -m launcher`'s arguments for the run: the recipe, every run's overrides, the run's swept
        values, and what the sweep sets: the run's folder, metrics.jsonl (the report reads it), and its name
        under the sweep's in the trackers (MLflow's experiment, W&B's group), and its checkpoints' folder below
        the recipe's checkpoint.dir, where it names one (the runs would mix their histories in one)."""
        name = self.folder.name
        every = [o for o in self.overrides if not o.startswith("run_dir=")]  # the sweep's folder: each run's below
        out = [self.recipe, *every, *run.overrides, f"run_dir={self.run_dir(run)}", "logging.jsonl=true"]
        if self.checkpoints and not any(o.startswith("checkpoint.dir=") for o in run.overrides):
            out.append(f"checkpoint.dir='{self.checkpoints.rstrip('/')}/{run.name}'")
        if "mlflow" in self.trackers:
            out += [f"logging.mlflow.experiment='{name}'", f"logging.mlflow.run_name='{run.name}'"]
        if "wandb" in self.trackers:
            out += [f"logging.wandb.group='{name}'", f"logging.wandb.run_name='{run.name}'"]
        return out

    def write(self) -> None:
        from launcher.checkpoint import write_text  # (with torch: not for `report` alone)

        self.folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"recipe": self.recipe, "overrides": self.overrides, "axes": self.axes,
                           "trackers": self.trackers, "checkpoints": self.checkpoints,
                           "runs": [{"name": r.name, "overrides": r.overrides} for r in self.runs]}, indent=1)
        write_text(self.folder / SWEEP, text + "\n")


def read(folder: Path) -> Sweep:
    path = Path(folder) / SWEEP
    try:
        saved = json.loads(path.read_text())
        runs = [Run(r["name"], tuple(tuple(o.split("=", 1)) for o in r["overrides"])) for r in saved["runs"]]
        return Sweep(Path(folder), saved["recipe"], saved["overrides"], saved["axes"], runs, saved.get("trackers", []),
                     saved.get("checkpoints"))
    except FileNotFoundError:
        raise UserError(f"{folder}: not a sweep's folder (no {SWEEP}); python -m launcher.sweep RECIPE key=a,b makes "
                        f"one") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a sweep's description ({type(e).__name__}: {e})") from None


def mark_exit(run_dir: Path, code: int, started: float) -> None:
    """Record how the run's process ended (and when it started: the report's wall time)."""
    from launcher.checkpoint import write_text  # (with torch: not for `report` alone)

    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / EXIT, json.dumps({"exit_code": code, "started": started, "ended": time.time()}) + "\n")


@dataclass
class Status:
    state: str  # done | running | failed | stopped | not started
    exit_code: Optional[int]
    last_step: Optional[int]
    total_steps: Optional[int]
    metrics: Dict[str, float]  # the last logged value of each
    history: List[Dict[str, Any]]  # every logged line
    seconds: Optional[float]  # wall time of its last process (or so far)

    def describe(self) -> str:
        if self.state == "failed":
            return f"failed (exit {self.exit_code})"
        if self.state == "stopped":
            return f"stopped at step {self.last_step}"
        return self.state


def status(run_dir: Path) -> Status:
    lines = _jsonl(run_dir / "metrics.jsonl")
    metrics: Dict[str, float] = {}
    for line in lines:
        metrics.update({k: v for k, v in line.items() if k not in ("step", "time")})
    last = lines[-1]["step"] if lines else None
    total = _total_steps(run_dir)
    ended = _json(run_dir / EXIT)
    code = ended.get("exit_code") if ended else None
    running = folder_lock.held(run_dir)
    seconds = None
    if ended and "started" in ended:
        seconds = (time.time() if running else ended.get("ended", time.time())) - ended["started"]
    if running:
        state = "running"
    elif total is not None and last == total:
        state = "done"
    elif code and 0 < code < 128:  # 128 + N (or -N from Python): a signal stopped it, saving; it resumes
        state = "failed"
    elif not run_dir.is_dir() or (last is None and ended is None):
        state = "not started"
    else:
        state = "stopped"
    return Status(state, code, last, total, metrics, lines, seconds)


def _total_steps(run_dir: Path) -> Optional[int]:
    config = _json(run_dir / "config.json") or {}
    return (config.get("effective") or {}).get("total_steps")


def _json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _jsonl(path: Path) -> List[Dict[str, Any]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    break  # a line cut by a kill
    except OSError:
        pass
    return out
