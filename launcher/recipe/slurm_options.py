"""The recipe's `slurm:` section: sbatch options for `python -m launcher.slurm submit` (its flags win)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

from launcher.errors import short
from launcher.recipe.checks import at_least


@dataclass
class SlurmConfig:
    """sbatch options for `python -m launcher.slurm submit`; its command-line flags win over these."""

    nodes: int = 1  # nodes to allocate
    gpus_per_node: int = 0  # GPUs per node; each rank takes the GPU of its local rank
    tasks_per_node: Optional[int] = None  # layout srun: processes per node (default: gpus_per_node, or 1)
    cpus_per_task: Optional[int] = None  # CPUs per task; null: Slurm's default
    mem: Optional[str] = None  # e.g. 32G
    time: str = "01:00:00"  # the job's time limit: MM, HH:MM:SS or D-HH:MM:SS
    partition: Optional[str] = None  # partition (queue); null: the cluster's default
    account: Optional[str] = None  # account to charge; null: your default
    qos: Optional[str] = None  # quality of service; null: the cluster's default
    job_name: Optional[str] = None  # default: the recipe's name
    output: Optional[str] = None  # default: <run_dir>/slurm/%j.out
    error: Optional[str] = None  # default: with the output
    layout: str = "torchrun"  # torchrun: one torchrun per node | srun: one task per process, srun alone
    signal_seconds: int = 120  # Slurm signals the job this long before its time limit: save and requeue
    python: str = "python"  # the interpreter on the nodes (after the setup lines)
    sbatch: List[str] = field(default_factory=list)  # extra "#SBATCH ..." lines, without the prefix
    setup: List[str] = field(default_factory=list)  # shell lines before the run: module loads, activations

    def problems(self) -> List[tuple[str, str]]:
        out = at_least("slurm.nodes", self.nodes, 1) + at_least("slurm.gpus_per_node", self.gpus_per_node, 0)
        out += at_least("slurm.tasks_per_node", self.tasks_per_node, 1) + at_least("slurm.cpus_per_task", self.cpus_per_task, 1)
        out += at_least("slurm.signal_seconds", self.signal_seconds, 0)
        if self.layout not in ("torchrun", "srun"):
            out.append(("slurm.layout", f"got {short(self.layout)}; valid: torchrun, srun"))
        if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", self.time):
            out.append(("slurm.time", f"got {short(self.time)}; Slurm's forms: MM, HH:MM:SS, D-HH:MM:SS"))
        return out
