"""Placement: which rank this process is and which device it trains on.

`place` is a pure function of the environment variables and the number of GPUs
this process can see, so it is tested with tables of environments. Nothing here
starts CUDA.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence, Tuple, Union

from launcher.errors import UserError

Devices = Union[str, Sequence[int]]


@dataclass(frozen=True)
class Placement:
    rank: int = 0  # global rank
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    device: str = "cpu"  # a torch device string
    gpu: Optional[str] = None  # the physical GPU, as CUDA_VISIBLE_DEVICES names it (index, UUID or MIG id)
    launched_by: str = "plain"  # plain | torchrun | accelerate | slurm

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def place(env: Mapping[str, str], devices: Devices, visible_gpus: int) -> Tuple[Placement, List[str]]:
    """The placement for this process, and notes worth one line each on the console.

    `visible_gpus` is torch.cuda.device_count() as this process sees it (the caller observes it).
    """
    rank, local_rank, world, local_world, node, launched_by = _ranks(env)
    notes: List[str] = []
    device, index = _device(devices, local_rank, visible_gpus, env, notes)
    gpu = None
    if index is not None:
        listed = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        gpu = listed[index] if index < len(listed) else str(index)
    return Placement(rank, local_rank, world, local_world, node, device, gpu, launched_by), notes


def _int(env: Mapping[str, str], name: str, default: Optional[str] = None) -> int:
    raw = env.get(name, default)
    if raw is None or not re.fullmatch(r"\d+", raw):
        raise UserError(f"environment variable {name}={raw!r} is not a non-negative integer")
    return int(raw)


def _tasks_on_node(spec: str, node: int) -> int:
    """Slurm's SLURM_STEP_TASKS_PER_NODE ('2(x3),1') for one node."""
    counts: List[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise UserError(f"environment variable SLURM_STEP_TASKS_PER_NODE={spec!r} is not Slurm's form, e.g. 2(x3),1")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else counts[-1]


def _ranks(env: Mapping[str, str]) -> tuple:
    if ("RANK" in env) != ("WORLD_SIZE" in env):  # set by hand: one alone would train as one process
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise UserError(f"environment: {given}={env[given]} is set but {missing} is not; torchrun sets both (with "
                        f"LOCAL_RANK, MASTER_ADDR, MASTER_PORT): set {missing} too, unset {given}, or start with torchrun")
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (and anything else that speaks its protocol)
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
        values = []
        for name in names:
            raw = env.get(name, "0" if name != "LOCAL_WORLD_SIZE" else env["WORLD_SIZE"])
            if not re.fullmatch(r"\d+", raw):
                raise UserError(f"environment variable {name}={raw!r} is not a non-negative integer")
            values.append(int(raw))
        rank, local_rank, world, local_world, node = values
        if world < 1 or rank >= world:
            raise UserError(f"environment: RANK={rank} must be below WORLD_SIZE={world}")
        if world > 1:
            _rendezvous(env, world)
        return rank, local_rank, world, local_world, node, _launcher(env, "torchrun")
    if "SLURM_STEP_NUM_TASKS" in env:  # a task of an srun step, started without torchrun
        world = _int(env, "SLURM_STEP_NUM_TASKS")
        rank, local_rank, node = _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NODEID", "0")
        local_world = _tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(world)), node)
        if rank >= world:
            raise UserError(f"environment: SLURM_PROCID={rank} must be below SLURM_STEP_NUM_TASKS={world}")
        return rank, local_rank, world, local_world, node, "slurm"
    launched_by = _launcher(env, "plain")
    if launched_by == "accelerate" and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        # accelerate's one-process path (--cpu, or fewer than 2 GPUs and no config) sets these only when
        # --num_processes asked for several; the others were never started, and one process would train alone.
        raise UserError("accelerate launch started one process where its --num_processes asked for several (it set "
                        "MASTER_ADDR and MASTER_PORT, no WORLD_SIZE): with --cpu, or fewer than 2 GPUs and no "
                        "`accelerate config`, it starts one; add --multi_gpu (on the CPU too): accelerate launch "
                        "--multi_gpu --num_processes N -m launcher ...")
    return 0, 0, 1, 1, 0, launched_by


def _rendezvous(env: Mapping[str, str], world: int) -> None:
    """Several processes meet at MASTER_ADDR:MASTER_PORT (torchrun sets both)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise UserError(f"environment: WORLD_SIZE={world} says several processes, but {' and '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not set; they name where rank 0 waits for the "
                        f"others (torchrun sets them): set MASTER_ADDR and MASTER_PORT, or start with torchrun")
    port = env["MASTER_PORT"]
    if not re.fullmatch(r"\d+", port) or not 0 < int(port) < 65536:
        raise UserError(f"environment variable MASTER_PORT={port!r} is not a port number (1 to 65535)")


# accelerate's truth values (accelerate.utils.environment.str_to_bool), so both read a flag alike.
TRUE, FALSE = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")


def flag(env: Mapping[str, str], name: str) -> bool:
    """An ACCELERATE_* on/off variable: unset is off; a value accelerate would refuse is a UserError."""
    raw = env.get(name)
    if raw is None or raw.lower() in FALSE:
        return False
    if raw.lower() in TRUE:
        return True
    raise UserError(f"environment variable {name}={raw!r} is not a truth value; valid: {', '.join(TRUE)} "
                    f"or {', '.join(FALSE)}")


def _launcher(env: Mapping[str, str], otherwise: str) -> str:
    # `accelerate launch` sets this in every form (one process, torchrun-style, config file).
    return "accelerate" if "ACCELERATE_MIXED_PRECISION" in env else otherwise


def _device(devices: Devices, local_rank: int, visible: int, env: Mapping[str, str], notes: List[str]):
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    seen = f"CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else "CUDA_VISIBLE_DEVICES unset"
    accelerate_cpu = flag(env, "ACCELERATE_USE_CPU")  # checked whatever `devices` says: accelerate reads it too
    if devices == "cpu":
        return "cpu", None
    if accelerate_cpu:
        notes.append("accelerate launch --cpu: training on the CPU")
        return "cpu", None
    if devices == "auto" and visible == 0:
        notes.append(f"devices: auto found no GPU ({seen}); training on the CPU")
        return "cpu", None
    if visible == 0:
        raise UserError(f"devices: {devices!r} asks for a GPU but none is visible ({seen}, "
                        f"torch.cuda.device_count() is 0); use devices=cpu or devices=auto", every_rank=True)
    if isinstance(devices, str) and devices.startswith("cuda:"):
        index = int(devices.split(":")[1])
        if index >= visible:
            raise UserError(f"devices: {devices} is not visible; this process sees {visible} GPU(s), "
                            f"cuda:0 to cuda:{visible - 1} ({seen})", every_rank=True)
        return devices, index
    # auto, cuda, auto:N and id lists: one GPU per local rank, or the only one each process sees.
    if visible == 1:
        return "cuda:0", 0
    if local_rank >= visible:
        raise UserError(f"local rank {local_rank} has no GPU: this process sees {visible} ({seen}); "
                        f"start at most {visible} processes per node", every_rank=True)
    return f"cuda:{local_rank}", local_rank


def table(rows: List[dict]) -> str:
    """One line per rank, aligned: what rank 0 prints at start."""
    heads = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in heads]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(str(r[h]).ljust(w) for h, w in zip(heads, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def select_gpus(devices: Devices, env: Mapping[str, str],
                query: Callable[[], Sequence[Tuple[str, int]]]) -> Optional[str]:
    """The CUDA_VISIBLE_DEVICES value that `devices: auto:N` or `[ids]` asks for, or None to leave it.

    `query()` lists the GPUs this process may use as (id, free MiB); it is called only for those
    two forms (the caller asks NVML through nvidia-smi, which creates no CUDA context).
    """
    if not ((isinstance(devices, str) and devices.startswith("auto:")) or isinstance(devices, (list, tuple))):
        return None
    gpus = list(query())
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    seen = f"visible: {', '.join(g for g, _ in gpus) or 'none'}" + (f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else "")
    if isinstance(devices, str) and devices.startswith("auto:"):
        n = int(devices.split(":")[1])
        if len(gpus) < n:
            raise UserError(f"devices: auto:{n} asks for {n} GPU(s), {seen}")
        # Most free memory first; the lower id breaks ties, so every rank picks the same set.
        ranked = sorted(enumerate(gpus), key=lambda item: (-item[1][1], item[0]))[:n]
        return ",".join(gpus[i][0] for i, _ in sorted(ranked))
    if isinstance(devices, (list, tuple)):
        ids = [str(d) for d in devices]
        listed = [g for g, _ in gpus]
        missing = [d for d in ids if d not in listed]
        if missing:
            raise UserError(f"devices: GPU {missing[0]} of {list(devices)} is not there; {seen}")
        return ",".join(ids)
    return None
