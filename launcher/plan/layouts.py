"""A layout (how the ranks share the model: a strategy over a number of ranks, tensor parallel, replicas, expert
parallel, and whether the blocks recompute), and the layouts worth planning on N devices, in the order of
preference: the least communication first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


@dataclass(frozen=True)
class Layout:
    """How the ranks share the model: a strategy over `world` ranks, the fsdp mesh's tp, dp_replicate and ep, and
    whether the model's blocks recompute their activations."""

    strategy: str  # single | ddp | fsdp
    world: int = 1
    tp: int = 1
    dp_replicate: int = 1
    recompute: bool = False
    ep: int = 1  # the ranks of dp_shard each MoE layer's experts are split over
    capacity: float = 1.0  # under ep: the (token, expert) pairs a rank's experts receive, over an even share

    def assumes(self) -> Optional[str]:
        """What the plan of this layout assumes that a run's values decide: under ep, where the router sends the
        tokens (fake tensors have no values to route by)."""
        if self.ep == 1:
            return None
        if self.capacity == 1:
            return f"the routed tokens spread evenly over the ep ranks (--ep-capacity 1; {self.ep}: all on one rank)"
        if self.capacity >= self.ep:
            return f"all of an ep group's routed tokens on this rank's experts (--ep-capacity {self.capacity:g})"
        return f"{self.capacity:g}x an even share of the routed tokens on this rank's experts (--ep-capacity " \
               f"{self.capacity:g})"

    @property
    def replicas(self) -> int:
        """The ranks that read a share of the batch of their own."""
        return self.world // self.tp

    @property
    def name(self) -> str:
        ac = " +ac" if self.recompute else ""
        if self.strategy in ("single", "ddp"):
            return (self.strategy if self.world == 1 else f"{self.strategy} x{self.world}") + ac
        shard = self.world // (self.tp * self.dp_replicate)
        parts = ([f"hsdp {self.dp_replicate}x{shard}"] if self.dp_replicate > 1 else [f"fsdp x{shard}"] if shard > 1
                 else [])
        if self.tp > 1:
            parts.append(f"tp x{self.tp}")
        if self.ep > 1:
            parts.append(f"ep x{self.ep}")
        return " ".join(parts or ["fsdp x1"]) + ac

    def overrides(self) -> List[str]:
        """The command line's keys for this layout."""
        out = [f"strategy={self.strategy}"]
        if self.strategy != "single":
            out.append(f"nproc_per_node={self.world}")
        if self.tp > 1:
            out.append(f"parallel.tp={self.tp}")
        if self.dp_replicate > 1:
            out.append(f"parallel.dp_replicate={self.dp_replicate}")
        if self.ep > 1:
            out.append(f"parallel.ep={self.ep}")
        if self.recompute:
            out.append("trainer.activation_checkpointing=auto")
        return out


# Per step and rank, in parameter bytes P: ddp all-reduces the gradients (2P); hsdp gathers and
# reduce-scatters within a shard group (3P) and all-reduces across replicas only a shard (2P / shard group);
# fsdp gathers twice and reduce-scatters over every rank (3P); recomputing adds a forward, not traffic;
# tensor parallel sends activations at every split layer, in forward and backward. Expert parallel gathers a
# layer's experts from dp_shard / ep ranks alone (3P_experts / ep), and sends each routed token's hidden state
# out and back, twice (forward, backward): less than the experts' gathers, for the models it is for.
PREFERENCE = ("single", "ddp", "hsdp", "fsdp", "fsdp+ac", "tp")


def candidates(devices: int, gpus_per_node: int = 8, ep: int = 1) -> List[Layout]:
    """Every layout of `devices` ranks the launcher runs: one process; ddp; fsdp with and without activation
    checkpointing; hsdp (replicas of a node's shard group, or two); tensor parallel of 2, 4, ... within a
    node, fsdp over the rest; and where `ep` (the recipe's parallel.ep) is above 1, fsdp, fsdp +ac, hsdp and
    each tensor-parallel layout with their experts split over ep ranks, where ep divides their dp_shard (under
    tp: the ranks left to fsdp). Pipeline stages (parallel.pp) are not planned."""
    if devices == 1:
        return [Layout("single"), Layout("single", recompute=True)]
    out = [Layout("ddp", devices), Layout("fsdp", devices), Layout("fsdp", devices, recompute=True)]
    shard = min(gpus_per_node, devices // 2)
    if shard > 1 and devices % shard == 0 and devices // shard > 1:
        out.append(Layout("fsdp", devices, dp_replicate=devices // shard))
    if ep > 1:
        out += [Layout("fsdp", devices, dp_replicate=f.dp_replicate, recompute=f.recompute, ep=ep) for f in out[1:]
                if (devices // f.dp_replicate) % ep == 0]
    tp = 2
    while tp <= min(devices, gpus_per_node) and devices % tp == 0:
        out.append(Layout("fsdp", devices, tp=tp))
        if ep > 1 and (devices // tp) % ep == 0:
            out.append(Layout("fsdp", devices, tp=tp, ep=ep))
        tp *= 2
    return out


def preference(layout: Layout) -> tuple:
    """A sort key: less communication first (a layout with expert parallel before the same without), then fewer
    tensor-parallel ranks."""
    if layout.tp > 1:
        kind = "tp"
    elif layout.strategy == "fsdp":
        kind = "hsdp" if layout.dp_replicate > 1 else "fsdp+ac" if layout.recompute else "fsdp"
    else:
        kind = layout.strategy
    return PREFERENCE.index(kind), layout.ep == 1, layout.recompute, layout.tp
