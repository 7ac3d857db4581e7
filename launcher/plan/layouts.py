"""The layouts worth planning on N devices, in the order of preference: the least communication first."""

from __future__ import annotations

from typing import List

from launcher.plan.fake import Layout

# Per step and rank, in parameter bytes P: ddp all-reduces the gradients (2P); hsdp gathers and
# reduce-scatters within a shard group (3P) and all-reduces across replicas only a shard (2P / shard group);
# fsdp gathers twice and reduce-scatters over every rank (3P); recomputing adds a forward, not traffic;
# tensor parallel sends activations at every split layer, in forward and backward.
PREFERENCE = ("single", "ddp", "hsdp", "fsdp", "fsdp+ac", "tp")


def candidates(devices: int, gpus_per_node: int = 8) -> List[Layout]:
    """Every layout of `devices` ranks the launcher runs: one process; ddp; fsdp with and without activation
    checkpointing; hsdp (replicas of a node's shard group, or two); tensor parallel of 2, 4, ... within a
    node, fsdp over the rest."""
    if devices == 1:
        return [Layout("single"), Layout("single", recompute=True)]
    out = [Layout("ddp", devices), Layout("fsdp", devices), Layout("fsdp", devices, recompute=True)]
    shard = min(gpus_per_node, devices // 2)
    if shard > 1 and devices % shard == 0 and devices // shard > 1:
        out.append(Layout("fsdp", devices, dp_replicate=devices // shard))
    tp = 2
    while tp <= min(devices, gpus_per_node) and devices % tp == 0:
        out.append(Layout("fsdp", devices, tp=tp))
        tp *= 2
    return out


def preference(layout: Layout) -> tuple:
    """A sort key: less communication first, then fewer tensor-parallel ranks."""
    if layout.tp > 1:
        kind = "tp"
    elif layout.strategy == "fsdp":
        kind = "hsdp" if layout.dp_replicate > 1 else "fsdp+ac" if layout.recompute else "fsdp"
    else:
        kind = layout.strategy
    return PREFERENCE.index(kind), layout.recompute, layout.tp
