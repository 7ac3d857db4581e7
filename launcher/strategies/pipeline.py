"""Pipeline parallelism (`parallel.pp: k` under strategy fsdp): the model cut into stages at its repeated blocks
(launcher/parallel/stages.py), each rank holding one stage (or several, for the interleaved schedules), the
batch split into `parallel.microbatches` that torch.distributed.pipelining's schedules pass from stage to stage.
Only activations and their gradients travel between stages. The stages are the outermost dimension of the mesh
(pp x dp_replicate x dp_shard x tp): within a stage, FSDP2 shards over the data-parallel ranks as it does
without stages.

The training is one process's: each micro-batch's loss is weighted as the loop weighs micro-batches (summed and
scaled to the step's items where the step counts them, a mean over the batch where it does not); the loss, the
metrics and the gradient norm are the whole model's, read from the last stage and the sum over the stages.
Checkpoints are keyed by the whole model's names (each stage writes its own), so they load under any layout."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.errors import UserError, first_line
from launcher.model.plain import to_cpu
from launcher.model.step import Result, items_in
from launcher.parallel import crossing, plans, stages
from launcher.recipe.ranks import PP_MULTI
from launcher.strategies.fsdp import FSDP, split_line

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "looped_bfs": "ScheduleLoopedBFS", "interleaved_zb": "ScheduleInterleavedZeroBubble",
             "zbv": "ScheduleZBVZeroBubble"}
KEPT = 8  # schedules kept, one per shape of batch (a padded batch's length changes the activations' shapes)


class Pipelined(nn.Module):
    """What the loop holds under pp: this rank's stages (their parameters are the ones it trains)."""

    def __init__(self, held: List[stages.Stage]):
        super().__init__()
        self.stages = nn.ModuleList(held)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model runs through its schedule (Pipeline.train_batch), not called")


class Pipeline(FSDP):
    name = "pp"
    held: List[stages.Stage] = []
    whole: nn.Module = None  # this rank's stages' modules under the whole model's names: what it saves and loads
    names: List[str] = []  # the whole model's state_dict keys, in its order (model.pt)
    counted: Optional[bool] = None  # whether the step counts its items (the last stage tells the others, once)
    tp_split: Dict[str, str] = {}  # the layers of this rank's stages split over the tp ranks (not `split`, which
    # would have the whole model's first batch tried again through the stages: assemble.wrapped)
    tp_added: Dict[str, str] = {}  # what the launcher added to the plan for those stages (per-head norms)

    def setup(self) -> None:
        super().setup()
        self.pp_group = self.device_mesh["pp"].get_group()
        rank = self.placement.rank
        self.indices = self._indices(self.shape.stage(rank))
        self.total = self.shape.pp * self.parallel.stages()
        pipeline = self.shape.pipeline(rank)
        self.holders = {i: pipeline[r] for r in range(self.shape.pp) for i in self._indices(r)}  # stage -> its rank
        self.last_rank = self.holders[self.total - 1]
        self.schedules: Dict[tuple, Any] = {}

    def _indices(self, stage_rank: int) -> List[int]:
        """The stages a rank holds: one; or v, looping (rank r holds r, r + pp, ...), or in a V for zbv."""
        pp, v = self.shape.pp, self.parallel.stages()
        if self.parallel.pp_schedule == "zbv":
            return [stage_rank, 2 * pp - 1 - stage_rank]
        return [stage_rank + i * pp for i in range(v)]

    def wrapped(self) -> List[str]:
        held = ", ".join(f"{s.index}" for s in self.held)
        blocks = "; ".join(f"stage {s.index}: {len(s.blocks)} block{'s' * (len(s.blocks) > 1)}" for s in self.held)
        lines = [f"parallel.pp: {self.shape.describe()} = {self.placement.world_size} ranks; {self.total} stages "
                 f"({self.parallel.pp_schedule}, {self.microbatches()} micro-batches), this rank holds stage "
                 f"{held} ({blocks})"]
        if self.shape.data_replicas > 1:
            lines += super().wrapped()  # (its tp line is for `split`, which a pipeline leaves empty)
        if self.tp_split:
            lines.append(split_line(self.tp_split, self.shape.tp, "layers of this rank's stages", self.tp_added))
        return lines

    def microbatches(self) -> int:
        return self.parallel.microbatches or self.total

    def wrap(self, model: nn.Module) -> nn.Module:
        blocks_name, blocks = stages.repeated_blocks(model)
        names = [f"{blocks_name}.{i}" for i in range(len(blocks))]
        ranges = stages.cut(len(blocks), self.total, names, self.parallel.pp_split)
        before, after = stages.placed(model, blocks_name)
        stages.refuse_split_ties(model, before, after)
        stages.refuse_unstandable(model, before)
        self.names = list(model.state_dict().keys())
        held = []
        for chunk, i in zip(stages.copies(model, len(self.indices)), self.indices):
            own = stages.prune(chunk, blocks_name, ranges[i], i == 0, i == self.total - 1, before, after)
            stage = stages.Stage(chunk, own, i, self.total)
            if self.shape.tp > 1:
                split, added = plans.apply(chunk, self.device_mesh["tp"], self.parallel.tp_plan)
                self.tp_split, self.tp_added = {**self.tp_split, **split}, {**self.tp_added, **added}
            if self.shape.data_replicas > 1 or self.shape.tp > 1:
                self.shard(stage, chunk)
            stage.hook()
            held.append(stage)
        self.held = held
        self.whole = stages.under_whole_names([s.model for s in held])
        return Pipelined(held)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.whole if self.whole is not None else super().unwrap(model)

    def builds_empty(self, pretrained: bool) -> bool:
        return False  # every rank builds the whole model and keeps its stages' share

    def no_sync(self, model: nn.Module, skip: bool):
        import contextlib

        return contextlib.nullcontext()  # torch's pipeline stage has FSDP reduce at each schedule step's last backward

    # the schedules

    def _schedule(self, batch: Any):
        """The schedule (and its stages' runtime) for batches of this shape, built at its first use."""
        from torch.distributed import pipelining

        n = self.microbatches()
        key = tuple((tuple(t.shape), t.dtype) for t in crossing.tensors(batch))
        if key in self.schedules:
            return self.schedules[key]
        if len(self.schedules) >= KEPT:
            self.schedules.pop(next(iter(self.schedules)))
        runtime = [stages.runtime(s, self.total, self.device, self.pp_group) for s in self.held]
        kind = getattr(pipelining.schedules, SCHEDULES[self.parallel.pp_schedule])
        multi = self.parallel.pp_schedule in PP_MULTI
        taken = inspect.signature(kind.__init__).parameters
        options = {"scale_grads": False} if "scale_grads" in taken else {}
        try:
            schedule = kind(runtime if multi else runtime[0], n, loss_fn=lambda out, target: out, **options)
        except ValueError as e:  # a schedule's own rule on its micro-batches (1F1B: at least as many as stages)
            raise UserError(f"parallel.microbatches: {n} with pp_schedule {self.parallel.pp_schedule}: "
                            f"{first_line(e)}") from None
        self.schedules[key] = schedule
        return schedule

    def _micro(self, rows: int) -> int:
        """The micro-batches a training batch of `rows` is split into."""
        if rows % self.microbatches():
            raise UserError(f"parallel.microbatches: {self.microbatches()} does not divide this rank's batch of {rows} "
                            f"rows (data.batch_size over {self.shape.data_replicas} data-parallel ranks); use a "
                            f"divisor of {rows}")
        return self.microbatches()

    def _ready(self, step: Callable, batch: Any, weigh: Callable) -> Dict[str, Any]:
        kwargs, unpack = crossing.as_keywords(batch)
        for stage in self.held:
            stage.step, stage.unpack, stage.weigh, stage.results = step, unpack, weigh, []
        return kwargs

    def _last(self) -> List[Tuple[Result, Any]]:
        return next((s.results for s in self.held if s.last), [])

    def _counts_items(self, results: List[Tuple[Result, Any]]) -> bool:
        """Whether the step counts its items: the last stage knows, and tells its pipeline once."""
        if self.counted is None:
            flag = torch.tensor([float(bool(results) and results[0][0].num_items is not None)], device=self.device)
            dist.broadcast(flag, src=self.last_rank, group=self.pp_group)
            self.counted = bool(flag.item())  # once per run
        return self.counted

    def train_batch(self, model, step, batch, precision, weights, last, before_backward):
        n = self._micro(items_in(batch))
        # item counts (and the loss weights made of them) in the parameters' precision, no less than float32: the
        # same on every stage, which all take part in reducing them
        counts = torch.promote_types(next(model.parameters()).dtype, torch.float32)

        def weigh(out: Result) -> torch.Tensor:  # the loss each micro-batch backwards, as the loop would weigh it
            if out.num_items is not None:  # summed: the gradients are scaled to the step's items at its end
                return out.loss * torch.as_tensor(out.num_items, device=out.loss.device).to(counts)
            return out.loss / (n * weights.accum)

        before_backward()
        kwargs = self._ready(step, batch, weigh)
        schedule = self._schedule(batch)
        with precision.autocast():  # (the schedules want a target; the last stage returns its loss itself)
            schedule.step(target=torch.zeros(n, device=self.device), return_outputs=False, **kwargs)
        results = self._last()
        counted = self._counts_items(results)
        zero = torch.zeros((), device=self.device, dtype=counts)
        entries = []  # the meter's, alike in shape and dtype on every stage: zeros where no loss is
        for i in range(n):
            out, part = results[i] if results else (None, batch if i == 0 else None)
            loss = weigh(out).detach() if out is not None else zero
            count = (torch.as_tensor(out.num_items, device=self.device).to(counts) if out is not None else zero) \
                if counted else None
            entries.append((loss, count, out, part))
        if counted:
            weights.summed(sum(count for _, count, _, _ in entries), last)
        return entries

    def eval_batch(self, model, step, batch, autocast):
        """Forward only, the whole batch at once, stage after stage (no schedule: a short last batch is as good)."""
        kwargs = self._ready(step, batch, lambda out: out.loss)
        mine, holder = {s.index: s for s in self.held}, self.holders
        activation: Optional[torch.Tensor] = None
        for index in range(self.total):
            if index not in mine:
                continue
            if index and holder[index - 1] != self.placement.rank:
                activation = crossing.receive(holder[index - 1], self.device)
            with autocast():
                activation = mine[index](*((activation,) if index else ()), **kwargs)
            if index + 1 < self.total and holder[index + 1] != self.placement.rank:
                crossing.send(activation, holder[index + 1])
        return self._last()

    # what crosses the stages

    def whole_norm(self, norm: torch.Tensor) -> torch.Tensor:
        squared = norm.to(torch.promote_types(norm.dtype, torch.float32)).pow(2)  # float64 stays float64
        dist.all_reduce(squared, group=self.pp_group)
        return squared.sqrt()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.data_group)  # this stage's data-parallel ranks
        dist.broadcast(tensor, src=self.last_rank, group=self.pp_group)  # the last stage's sums, on every stage
        return tensor

    # checkpoints: keyed by the whole model's names

    def state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(self.whole, optimizer, options=StateDictOptions(full_state_dict=False))

    def load_state_dicts(self, model, optimizer, model_state, optimizer_state, full: bool) -> None:
        if full:  # the whole model's: this rank's stages' share of it
            keys = set(self.whole.state_dict())
            params = {name for name, _ in self.whole.named_parameters()}
            model_state = {k: v for k, v in model_state.items() if k in keys}
            optimizer_state = {"state": {k: v for k, v in optimizer_state.get("state", {}).items() if k in params},
                               "param_groups": [{**g, "params": [p for p in g["params"] if p in params]}
                                                for g in optimizer_state["param_groups"]]}
        super().load_state_dicts(model, optimizer, model_state, optimizer_state, full)

    def share(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's stages' keys of the whole model's state (and any key the whole model lacks: a mistake that
        fitting names)."""
        local, whole = set(self.whole.state_dict()), set(self.names)
        return {k: v for k, v in state.items() if k in local or k not in whole}

    def model_state(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The whole model on rank 0: each stage gathers its own (over its data-parallel ranks), its first rank
        sends it to rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        own = get_model_state_dict(self.whole, options=StateDictOptions(full_state_dict=True))
        rank = self.placement.rank
        sends = rank % self.shape.stage_ranks == 0
        mine = to_cpu({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in own.items()}) if sends else {}
        parts: Optional[List[Any]] = [None] * self.placement.world_size if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if rank != 0:
            return {}
        gathered: Dict[str, torch.Tensor] = {}
        for part in parts:
            gathered.update(part or {})
        return {k: gathered[k] for k in self.names if k in gathered}

    def teardown(self) -> None:
        self.schedules, self.held, self.whole, self.pp_group = {}, [], None, None
        super().teardown()
