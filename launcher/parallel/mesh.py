"""The ranks of a run laid out on a device mesh: pp x dp_replicate x dp_shard x cp x tp, pipeline stages outermost
and tp innermost (the ranks of one tensor-parallel group are neighbours: one node's GPUs; torchtitan's order).
Global rank = ((stage x data-parallel ranks + data-parallel rank) x cp + cp rank) x tp + tp rank.

The ranks of one tp group, of one cp group, and the stages of one pipeline, read the same batch; the global batch
is split over the data-parallel ranks (dp_replicate x dp_shard) alone, so a recipe's batch means what it means under
every layout. A cp group's ranks each take a contiguous 1/cp of every sequence of that batch
(launcher/parallel/ulysses.py), so their gradients are of different tokens: FSDP shards over dp_shard x cp together
and averages the gradients over both (torchtitan's dp_shard_cp), and a checkpoint does not depend on cp.

Expert parallelism (ep) splits dp_shard in two, dp_shard_mod_ep x ep, ep innermost (torchtitan's order): the ep
ranks of one group are neighbours, and read different tokens. The dense parts are sharded over dp_shard as
without ep, each experts module over dp_shard_mod_ep (the ranks that hold the same experts), its experts split
over ep (launcher/parallel/experts.py).

With tp too, ep is still taken from dp_shard alone (torchtitan's ep with etp = tp, less the experts' own tensor
parallelism): the dense layers are split over tp by the plan, the experts are not. Each rank of a tp group holds
its ep slice whole and, as the group's ranks read one batch and the split layers hand the experts whole hidden
states, routes the same tokens over its own ep group (the ranks of its tp rank): the same all-to-alls and expert
matmuls on each, and the same gradients, so nothing is reduced over tp for them. (Splitting each expert's
matmuls over tp would need transformers' packed gate_up_proj split by halves, and an all-reduce after
down_proj; torchtitan's other choice, etp = 1, takes ep from tp's ranks too and splits the tokens over them.)
At rest the experts are split over dp_shard's ranks, not the world's: tp times what each rank would hold of
them were every rank in dp_shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from launcher.errors import UserError

NAMES = ("dp_replicate", "dp_shard", "tp")
PP_NAMES = ("pp",) + NAMES
CP_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    ep: int = 1  # the ranks each MoE layer's experts are split over, of dp_shard's
    cp: int = 1  # the ranks each sequence is split over (along its length), which read one batch

    @property
    def data_replicas(self) -> int:
        """The ranks that each read their own share of the batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def gradient_ranks(self) -> int:
        """The ranks whose gradients FSDP averages: each data-parallel rank's cp ranks hold different tokens."""
        return self.data_replicas * self.cp

    @property
    def stage_ranks(self) -> int:
        """The ranks of one pipeline stage (every rank when there is one stage)."""
        return self.data_replicas * self.cp * self.tp

    def data_rank(self, rank: int) -> int:
        return (rank % self.stage_ranks) // (self.tp * self.cp)

    def cp_rank(self, rank: int) -> int:
        """This rank's place in its cp group: which 1/cp of each sequence it holds."""
        return (rank // self.tp) % self.cp

    def stage(self, rank: int) -> int:
        return rank // self.stage_ranks

    def pipeline(self, rank: int) -> List[int]:
        """The ranks of this rank's pipeline (one per stage, the same data and tp rank), first stage first."""
        return [rank % self.stage_ranks + s * self.stage_ranks for s in range(self.pp)]

    @property
    def plain(self) -> bool:
        """One dimension: every rank shards the model and reads its own share (FSDP alone)."""
        return self.tp == 1 and self.dp_replicate == 1 and self.pp == 1 and self.ep == 1 and self.cp == 1

    def describe(self) -> str:
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        said = " x ".join(f"{name} {size}" for name, size in zip(("pp",) + CP_NAMES, sizes)
                          if size > 1 or name == "dp_shard")
        return said.replace(f"dp_shard {self.dp_shard}", f"dp_shard {self.dp_shard} (ep {self.ep})", 1) if self.ep > 1 \
            else said


def layout(tp: int, dp_replicate: int, world_size: int, pp: int = 1, ep: int = 1, cp: int = 1) -> Layout:
    """The mesh for `world_size` ranks; one line when the sizes do not divide it."""
    if cp > 1 and world_size % (tp * dp_replicate * pp * cp):
        sizes = " x ".join(f"{k}={v}" for k, v in (("cp", cp), ("pp", pp), ("tp", tp), ("dp_replicate", dp_replicate))
                           if v > 1)
        raise UserError(f"parallel.cp: {sizes} does not divide the world of {world_size} processes; use sizes whose "
                        f"product divides {world_size} (dp_shard takes the rest)")
    if world_size % (tp * dp_replicate * pp):
        if pp == 1:
            key = ("parallel.tp" if dp_replicate == 1 else "parallel.dp_replicate" if tp == 1
                   else "parallel.tp x dp_replicate")
        else:
            key = "parallel.pp" if tp == dp_replicate == 1 else "parallel.pp x tp x dp_replicate"
        sizes = (f"tp={tp} x dp_replicate={dp_replicate}" if pp == 1 else
                 " x ".join(f"{k}={v}" for k, v in (("pp", pp), ("tp", tp), ("dp_replicate", dp_replicate)) if v > 1))
        raise UserError(f"{key}: {sizes} does not divide the world of {world_size} processes; use sizes whose "
                        f"product divides {world_size} (dp_shard takes the rest)")
    shard = world_size // (tp * dp_replicate * pp * cp)
    if shard % ep:
        raise UserError(f"parallel.ep: ep={ep} does not divide the {shard} ranks of dp_shard (world {world_size}"
                        f"{f' / dp_replicate {dp_replicate}' if dp_replicate > 1 else ''}); use an ep that divides "
                        f"{shard}")
    return Layout(dp_replicate, shard, tp, pp, ep, cp)


def device_mesh(shape: Layout, device_type: str):
    """The named mesh; collective (every rank builds it, in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape.plain:
        return init_device_mesh(device_type, (shape.dp_shard,))
    if shape.pp > 1:
        return init_device_mesh(device_type, (shape.pp, shape.dp_replicate, shape.dp_shard, shape.tp),
                                mesh_dim_names=PP_NAMES)
    if shape.cp > 1:
        return init_device_mesh(device_type, (shape.dp_replicate, shape.dp_shard, shape.cp, shape.tp),
                                mesh_dim_names=CP_NAMES)
    return init_device_mesh(device_type, (shape.dp_replicate, shape.dp_shard, shape.tp), mesh_dim_names=NAMES)


def data_mesh(mesh, shape: Layout):
    """What FSDP2 shards over: dp_shard (with cp: dp_shard x cp flattened), and dp_replicate before it for HSDP."""
    if shape.plain:
        return mesh
    if shape.cp > 1:  # a cp group's ranks hold different tokens: their gradients are averaged as dp_shard's are
        flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh["dp_replicate", "dp_shard_cp"] if shape.dp_replicate > 1 else flat
    return mesh["dp_replicate", "dp_shard"] if shape.dp_replicate > 1 else mesh["dp_shard"]


def experts_mesh(mesh, shape: Layout):
    """Under ep: the mesh with dp_shard split in two, dp_replicate x dp_shard_mod_ep x ep x tp; collective (its
    groups are made)."""
    return mesh._unflatten("dp_shard", (shape.dp_shard // shape.ep, shape.ep), ("dp_shard_mod_ep", "ep"))


def holders_mesh(experts, shape: Layout):
    """What FSDP2 shards each experts module over under ep: the ranks that hold the same experts."""
    return experts["dp_replicate", "dp_shard_mod_ep"] if shape.dp_replicate > 1 else experts["dp_shard_mod_ep"]


def forget() -> None:
    """When a run's mesh goes: DTensor's sharding propagation keeps each op's output layout by its inputs', and a
    mesh equals any other of the same shape and names, so a later run in this process (the tests' runs, one
    after another in a pool of ranks) would get this run's mesh back, whose process groups are gone (ep under
    HSDP after ep under fsdp alone: `Could not resolve the process group registered under the name 12`)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # both: the Python one and the C++ fast path's


def quiet_redistribution() -> None:
    """DTensor warns, on every rank, each time it reduces or gathers over two mesh dimensions one after the other
    (the gradients' norm, a save's gather), that its reduction orders could differ between ranks. Both are
    deterministic collectives whose every participant gets the same result; the warning is left out."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
        lambda record: not str(record.msg).startswith("While redistributing"))


def data_group(shape: Layout, rank: int):
    """The process group of this rank's data-parallel peers (the same stage and tp rank), where the metrics and the
    item counts are summed; None (the world) when every rank is one. Collective."""
    import torch.distributed as dist

    if shape.tp == 1 and shape.pp == 1:  # (a cp group's ranks hold different tokens: they sum too)
        return None
    n = shape.stage_ranks
    groups = [list(range(s * n + t, (s + 1) * n, shape.tp)) for s in range(shape.pp) for t in range(shape.tp)]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine
