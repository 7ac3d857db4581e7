"""FSDP2 (torch.distributed.fsdp.fully_shard): parameters, gradients and optimizer state sharded over the
ranks, one process per device as under DDP (started by torchrun, or by the launcher through it; gloo
on the CPU, nccl on CUDA). Each sharding unit (`fsdp.units`: class names, by default the model's
repeated layers) gathers its parameters for its forward and backward and reduce-scatters its gradients;
the root holds what is left. Checkpoints are written by every rank as shards (DCP), so a run resumes at
any world size; model.pt is gathered on rank 0.

Under expert parallelism (parallel.ep) each experts module is a unit of its own, sharded over the ranks that
hold the same experts (dp_shard / ep, and dp_replicate), its slices split over the ep ranks before
(launcher/parallel/experts.py, which says why FSDP's average over those ranks gives one process's gradient).
With tp the dense layers are split by the plan first and the experts are not: each rank of a tp group holds
its ep slice whole and routes the group's tokens, the same on each (launcher/parallel/mesh.py).

Under context parallelism (parallel.cp) the ranks of a cp group read one batch and each trains on a contiguous
1/cp of every sequence (launcher/model/sequence.py), its attention computed across the split
(launcher/parallel/ulysses.py); FSDP shards over dp_shard x cp, whose gradients it averages, and the item counts are
summed over both, so a step's gradient is one process's."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from launcher.model import modules, sequence
from launcher.errors import UserError
from launcher.parallel import experts, mesh, plans, ulysses
from launcher.model.plain import tied_names
from launcher.model.step import ModelLoss
from launcher.strategies.ddp import DDP

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_UNCOUNTED = ("parallel.cp: the model's loss gives no count of its scored tokens, which a split sequence needs (each "
              "rank scores its part, and the parts' counts make the mean): give batches with labels to a model that "
              "takes num_items_in_batch (transformers' causal LMs do), or set parallel.cp=1")


class FSDP(DDP):
    name = "fsdp"
    sharded = True
    precision = "fp32"
    units: List[str] = []
    left: List[str] = []  # default units left to the root, which would have split a tied parameter
    split: Dict[str, str] = {}  # the layers split over the tp ranks, with their styles
    added: Dict[str, str] = {}  # what the launcher added to the plan (per-head norms: launcher/parallel/heads.py)
    expert_split: Dict[str, int] = {}  # the experts modules split over the ep ranks, with their expert counts
    shape: mesh.Layout
    device_mesh = None
    experts_mesh = None  # under ep: the mesh with dp_shard split into dp_shard_mod_ep x ep
    context: List[str] = []  # under cp: the console's line on how the sequences are split

    def setup(self) -> None:
        # before the process group: a world the mesh does not fit stops every rank at once, with one line
        p = self.parallel
        self.shape = mesh.layout(p.tp, p.dp_replicate, self.placement.world_size, p.pp, p.ep, p.cp)
        super().setup()
        self.device_mesh = mesh.device_mesh(self.shape, self.device.type)
        self.experts_mesh = mesh.experts_mesh(self.device_mesh, self.shape) if self.shape.ep > 1 else None
        self.data_group = mesh.data_group(self.shape, self.placement.rank)
        if not self.shape.plain:
            mesh.quiet_redistribution()

    def data_share(self) -> Tuple[int, int]:
        return self.shape.data_replicas, self.shape.data_rank(self.placement.rank)

    def gradient_share(self) -> int:
        return self.shape.gradient_ranks  # a cp group's ranks hold different tokens: FSDP averages over them too

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(tensor) / self.shape.gradient_ranks  # the ranks data_group sums over

    def layout(self) -> str:
        return f"shards of {self.shape.describe()}"

    def data_states(self, state):
        # the ranks of a tp group, and the stages of a pipeline, read the same: the first stage's, a tp rank each
        return self.all_gather_object(state)[:self.shape.stage_ranks:self.shape.tp * self.shape.cp]

    def settle(self, precision: str, grad_accum: int) -> Tuple[str, int, List[str]]:
        if precision == "fp16":  # the grad scaler's unscale has no kernel for sharded (DTensor) gradients
            raise UserError("precision: fp16 needs a grad scaler, which strategy fsdp does not shard; use precision=bf16 "
                            "(no scaler needed) or fp32 with fsdp, or fp16 with strategy=ddp")
        self.precision = precision
        return precision, grad_accum, []

    def notes(self) -> List[str]:
        if self.fsdp.cpu_offload and self.device.type != "cuda":
            return ["fsdp.cpu_offload: the run is on the CPU already; nothing to offload"]
        return []

    def wrapped(self) -> List[str]:
        units = ", ".join(self.units) or "none (the root alone)"
        left = (f" ({', '.join(self.left)} left to the root: it holds a weight tied to one outside it)"
                if self.left else "")
        if self.shape.plain:
            return [f"fsdp: sharded over {self.placement.world_size} ranks; units {units}{left}"]
        over = "dp_shard x cp" if self.shape.cp > 1 else "dp_shard"
        over = f"dp_replicate x {over}" if self.shape.dp_replicate > 1 else over
        lines = [f"fsdp: {self.shape.describe()} = {self.placement.world_size} ranks; sharded over {over}, units "
                 f"{units}{left}"] + self.context
        if self.split:
            lines.append(split_line(self.split, self.shape.tp, "layers", self.added))
        if self.expert_split:
            lines.append(experts_line(self.expert_split, self.shape))
        return lines

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.shape.tp > 1:  # before FSDP2 shards what the plan leaves whole, and the split layers' other dimension
            self.split, self.added = plans.apply(model, self.device_mesh["tp"], self.parallel.tp_plan)
        if self.shape.ep > 1:  # the experts' slices before FSDP2 shards them over the ranks that hold the same
            self.expert_split = experts.split(model, self.experts_mesh["ep"])
        if self.shape.cp > 1:
            self.context = ulysses.install(model, self.shape.cp)
        self.shard(model, model)
        return model

    def shard(self, root: nn.Module, model: nn.Module) -> None:
        """FSDP2 over `root`: `model`'s units (inside it) sharded each on their own, the rest by the root."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        names = self.fsdp.units if self.fsdp.units is not None else modules.default_units(model)
        found = modules.by_class(model, names, "fsdp.units") if names else []
        kept = _keeping_ties(model, found, named=self.fsdp.units is not None)
        self.left = list(dict.fromkeys(type(m).__name__ for m in found if all(m is not k for k in kept)))
        found = kept
        self.units = list(dict.fromkeys(type(m).__name__ for m in found))
        # Parameters compute in the recipe's precision (autocast still runs, as under every strategy);
        # gradients are reduced in fsdp.reduce_dtype and kept in the parameters' shards for the optimizer.
        param_dtype = torch.bfloat16 if self.precision in ("bf16", "fp8") else None
        options = {"mesh": mesh.data_mesh(self.device_mesh, self.shape),
                   "reshard_after_forward": self.fsdp.reshard_after_forward,
                   "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=self._reduce_dtype(root)),
                   "offload_policy": CPUOffloadPolicy() if self.fsdp.cpu_offload and self.device.type == "cuda"
                   else OffloadPolicy()}
        holders = {**options, "mesh": mesh.holders_mesh(self.experts_mesh, self.shape)} if self.expert_split else {}
        for name in self.expert_split:  # a unit over the ranks that hold its experts (experts.py: why they average)
            fully_shard(model.get_submodule(name), **holders)
        for unit in reversed(found):  # innermost first: a unit inside another is its own shard group
            fully_shard(unit, **options)
        fully_shard(root, **options)
        if self.shape.tp > 1:  # its output a split layer's: a view FSDP2 warns of (quiet_split_output: why not)
            plans.quiet_split_output(type(root).__name__)

    def _reduce_dtype(self, model: nn.Module):
        """fsdp.reduce_dtype, never narrower than the parameters: fp32 (the default) leaves a float64 model's
        gradients in float64, as ddp does, instead of rounding each step's sum to float32."""
        asked = DTYPES[self.fsdp.reduce_dtype]
        if asked == torch.float32 and any(p.dtype == torch.float64 for p in model.parameters()):
            return None  # the parameters' own
        return asked

    def train_batch(self, model: nn.Module, step: Callable, batch: Any, precision: Any, weights: Any, last: bool,
                    before_backward: Callable[[], None]) -> List[Tuple[torch.Tensor, Any, Any, Any]]:
        if self.shape.cp == 1:
            return super().train_batch(model, step, batch, precision, weights, last, before_backward)
        mine, whole = self._split(step, batch)
        with ulysses.splitting(whole):  # forward and backward: recomputed blocks run their attention again
            (loss, count, out, _), = super().train_batch(model, step, mine, precision, weights, last, before_backward)
        if count is None:
            raise UserError(_UNCOUNTED)
        return [(loss, count, out, batch)]  # the whole batch: its tokens counted once a cp rank for tokens/s

    def eval_batch(self, model: nn.Module, step: Callable, batch: Any, autocast: Callable) -> List[Tuple[Any, Any]]:
        if self.shape.cp == 1:
            return super().eval_batch(model, step, batch, autocast)
        mine, whole = self._split(step, batch)
        with ulysses.splitting(whole):
            (out, _), = super().eval_batch(model, step, mine, autocast)
        if out.num_items is None:
            raise UserError(_UNCOUNTED)
        return [(out, mine)]

    def _split(self, step: Callable, batch: Any) -> Tuple[Dict[str, Any], ulysses.Whole]:
        if not isinstance(step, ModelLoss):  # (a DPO step sums each sequence's log-probabilities: over the split too)
            raise UserError(f"parallel.cp: splits sequences for the model's own loss (no step: or loss: in the "
                            f"recipe), and the step is {type(step).__name__}, which is not built under cp yet; set "
                            f"parallel.cp=1")
        rank = self.shape.cp_rank(self.placement.rank)
        mine, inputs = sequence.split(batch, self.shape.cp, rank, getattr(step, "labels", "labels"))
        return mine, ulysses.Whole(self.device_mesh["cp"].get_group(), self.shape.cp, **inputs)

    def builds_empty(self, pretrained: bool) -> bool:
        return pretrained and self.fsdp.empty_init

    def after_forward(self, model: nn.Module) -> None:
        # The root keeps its gathered parameters after a forward, for the backward that follows; without
        # one they are sharded again, so that the optimizer is built over the shards.
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def teardown(self) -> None:
        # their process groups too are released before the default one ends (DDP.teardown)
        self.device_mesh = self.experts_mesh = None
        mesh.forget()
        super().teardown()

    def no_sync(self, model: nn.Module, skip: bool):
        # FSDP reads the flag when a unit's backward ends (DDP reads it in forward), so it is set for the
        # whole micro-step, forward and backward, and every micro-step sets it.
        self.unwrap(model).set_requires_gradient_sync(not skip)
        return super().no_sync(model, skip=False)

    def model_state(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathered unit by unit into rank 0's CPU memory: no rank holds the whole model on its device.
        return get_model_state_dict(self.unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def split_line(split: Dict[str, str], tp: int, what: str, added: Dict[str, str]) -> str:
    """The console's line for the layers tensor parallelism split: how many, the first few with their styles, and
    the patterns the launcher added to the plan (a plan copied without its per-head norms trains wrong silently)."""
    how = ", ".join(f"{n} ({s})" for n, s in list(split.items())[:4])
    more = f" and {len(split) - 4} more" if len(split) > 4 else ""
    norms = (f"; added to the plan: {', '.join(f'{p}: {s}' for p, s in added.items())} (per-head norms after a "
             f"colwise split, which train as one process's only so; name them in parallel.tp_plan to choose)"
             if added else "")
    return f"parallel.tp: {len(split)} {what} split over {tp} ranks: {how}{more}{norms}"


def experts_line(split: Dict[str, int], shape: mesh.Layout) -> str:
    """The console's line for what expert parallelism split: the modules, each rank's experts, who else holds them."""
    names = list(split)
    how = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    each = " or ".join(str(c // shape.ep) for c in sorted(set(split.values())))
    shard = shape.dp_shard // shape.ep
    where = " and ".join(([f"each sharded over the {shard} ranks of dp_shard that hold them"] if shard > 1 else []) +
                         ([f"replicated over dp_replicate {shape.dp_replicate}"] if shape.dp_replicate > 1 else []) +
                         ([f"whole on each of tp's {shape.tp} ranks (which route the same tokens)"] if shape.tp > 1
                          else []))
    return (f"parallel.ep: {len(names)} experts modules split over {shape.ep} ranks, {each} experts on each ({how}); "
            f"{where or 'no other rank holds them'}")


def _keeping_ties(model: nn.Module, units: List[nn.Module], named: bool) -> List[nn.Module]:
    """The units less those that would split a tied parameter (an input embedding shared with the output
    layer) between two FSDP groups, which fully_shard refuses: by default such a unit is left to the
    root, which then holds every use of the parameter; units the recipe names are a mistake, one line."""
    while True:
        split = _split_ties(model, units)
        if split is None:
            return units
        names, owners = split
        if named:
            where = " and ".join(f"unit {type(o).__name__}" if o is not model else "the root" for o in owners)
            raise UserError(f"fsdp.units: {' and '.join(repr(n) for n in names)} are one tied parameter, which these "
                            f"units split between {where}; leave {', '.join(sorted({type(o).__name__ for o in owners if o is not model}))} "
                            f"out of fsdp.units, or untie the weights")
        units = [u for u in units if u not in owners]


def _split_ties(model: nn.Module, units: List[nn.Module]):
    """(the names of one parameter, the modules whose groups would hold it) for the first tied parameter
    whose names fall in different groups; None when none does."""
    paths = {id(m): path for path, m in model.named_modules() if any(m is u for u in units)}
    by_path = {path: next(u for u in units if id(u) == key) for key, path in paths.items()}
    for names in tied_names(model):
        owners = []
        for name in names:
            inside = [p for p in by_path if name.startswith(p + ".")]
            owner = by_path[max(inside, key=len)] if inside else model
            if all(owner is not o for o in owners):
                owners.append(owner)
        if len(owners) > 1:
            return names, owners
    return None
