"""What the machine says of its GPUs, outside CUDA: the free memory of each (for `devices: auto:N`, before a
CUDA context exists), and each rank's row of the table a run starts with."""

from __future__ import annotations

import os
from typing import Any, Dict

import torch

from launcher.placement.scheduler import Placement


def nvidia_smi() -> list:
    """The GPUs this process may use as (id, free MiB), from nvidia-smi: no CUDA context is created."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.count(",") == 2]
    allowed = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return [(index, int(free)) for index, uuid, free in rows if not allowed or index in allowed or uuid in allowed]


def row(placement: Placement) -> Dict[str, Any]:
    row = {"rank": placement.rank, "local rank": placement.local_rank, "node": placement.node_rank,
           "device": placement.device, "physical GPU": "-"}
    if placement.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(placement.device))
        row["physical GPU"] = f"{placement.gpu} {props.name} {getattr(props, 'uuid', '')}".strip()
    return row
