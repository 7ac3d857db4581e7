"""The strategy contract: what every strategy does, with the defaults of a single process."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple, TypeVar

import torch
from torch import nn

from launcher.errors import UserError
from launcher.model.plain import to_cpu, unwrap
from launcher.model.step import result
from launcher.recipe.ranks import DDPConfig, FSDPConfig, ParallelConfig
from launcher.placement.scheduler import Placement
from launcher.strategies import peers

T = TypeVar("T")


# Set once this process has ended a process group: python -m launcher then exits without the interpreter's
# finalization (launcher/__main__.py says why).
ended_a_process_group = False


@dataclass
class Live:
    """What training holds between two steps, as the loop has it; fault tolerance hands it to a group that joins,
    or replaces it with a live group's."""

    model: nn.Module  # as wrapped
    optimizer: torch.optim.Optimizer
    schedule: Optional[Any]
    precision: Any  # its grad scaler's state
    position: Any  # step, epoch, batch: where the next step reads
    data: Any  # the training data (map-style, or a stream)
    say: Callable[[str], None]  # a line on the console (rank 0's)


def end_process_group() -> None:
    """Destroy the default process group, once every rank is done with it (teardown)."""
    global ended_a_process_group
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        ended_a_process_group = True


class Strategy:
    """One process's share of a run. The defaults are those of a single process."""

    name = "base"
    sharded = False  # checkpoints: rank 0 writes full state files; a sharded strategy's ranks write shards (DCP)

    def __init__(self, placement: Placement, ddp: Optional[DDPConfig] = None, fsdp: Optional[FSDPConfig] = None,
                 parallel: Optional[ParallelConfig] = None):
        self.placement = placement
        self.device = torch.device(placement.device)
        self.ddp = ddp or DDPConfig()  # the recipe's ddp section: the strategies that wrap in DDP read it
        self.fsdp = fsdp or FSDPConfig()  # the recipe's fsdp section: the sharded strategy reads it
        self.parallel = parallel or ParallelConfig()  # the recipe's parallel section (the device mesh), for fsdp
        self.timeout: float = 600  # dist_timeout: how long a collective waits for the other ranks (seconds)
        self.run_dir: Optional[str] = None

    def setup(self) -> None:
        """Start whatever the strategy needs (a process group); called before anything is built."""

    def flight_recorder(self) -> Optional[str]:
        """Where a timed-out collective's record of each rank's last collectives lands (NCCL), if anywhere."""
        return None

    def settle(self, precision: str, grad_accum: int) -> Tuple[str, int, List[str]]:
        """The precision and accumulation to train with, when the launch method has a say in them."""
        return precision, grad_accum, []

    def notes(self) -> List[str]:
        """Lines for the console about how this strategy runs here (say, a fallback)."""
        return []

    def data_share(self) -> Tuple[int, int]:
        """(how many ranks read a share of each batch of their own, this rank's place among them): every rank,
        unless ranks compute one batch together (tensor parallel)."""
        return self.placement.world_size, self.placement.rank

    def gradient_share(self) -> int:
        """How many ranks' gradients a step averages: data_share's count, unless gradients are averaged further
        across groups of ranks (fault tolerance's live replica groups)."""
        return self.data_share()[0]

    def trained_share(self) -> float:
        """The part of each global batch the last committed step trained: all of it, unless replica groups were
        down at it (fault tolerance: the live groups' shares)."""
        return 1.0

    def val_share(self) -> Tuple[int, int]:
        """data_share for validation: how many ranks read their own share of data.val, this rank's place."""
        return self.data_share()

    def sum_counts(self, count: torch.Tensor) -> torch.Tensor:
        """A step's item `count` summed, in place, over every rank whose gradients the step averages. Collective."""
        return self.all_reduce_sum(count)

    def data_states(self, state: Any) -> List[Any]:
        """Every data-parallel rank's `state` (its place in a stream), in the order of data_share. Collective."""
        return self.all_gather_object(state)

    def layout(self) -> str:
        """How each process holds the model, in a few words: "whole", or the mesh whose shards it holds. Replica
        groups must agree on it (rank r of each averages its gradients with rank r of the others)."""
        return "whole"

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model to train, already on `self.device`, wrapped for this strategy."""
        return model

    def wrapped(self) -> List[str]:
        """Lines for the console about how wrap() wrapped the model (say, how it was sharded)."""
        return []

    def builds_empty(self, pretrained: bool) -> bool:
        """Whether the model is built on the meta device and allocated when wrapped (sharded, from
        pretrained weights): every rank would otherwise hold the whole model first."""
        return False

    def after_forward(self, model: nn.Module) -> None:
        """After a forward without a backward (the first batch's check) on the wrapped model."""

    def no_sync(self, model: nn.Module, skip: bool) -> ContextManager:
        """A context in which backward does not synchronise gradients (accumulation micro-steps)."""
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap(model)

    def begin_step(self, live: Live) -> bool:
        """Before a step reads its first batch. True when `live` (weights, optimizer, schedule, RNG, position) was
        just replaced by a live peer's (fault tolerance's live recovery): the loop then reads its batches from the
        position it now holds."""
        return False

    def commit(self, params: List[torch.Tensor]) -> bool:
        """After the step's last backward, before the optimizer steps: whether it steps. False drops the step (a
        replica group failed during it), which the loop trains again from the same batches."""
        return True

    def writes_checkpoints(self) -> bool:
        """Whether this process's group writes the periodic checkpoints (under fault tolerance, the lowest live
        group alone; every group writes the final one, into its own run folder)."""
        return True

    def train_batch(self, model: nn.Module, step: Callable, batch: Any, precision: Any, weights: Any, last: bool,
                    before_backward: Callable[[], None]) -> List[Tuple[torch.Tensor, Optional[torch.Tensor], Any, Any]]:
        """One micro-batch's forward and backward: `step(model, batch)`, its loss weighted by `weights` (the loop's
        LossWeights; `last`: the micro-batch whose backward synchronises the gradients), `before_backward()` called
        between the two. Returns what the meter records, per part of the batch: (its loss, summed where counted,
        else a mean divided by the accumulation steps; its item count or None; the step's result, or None where
        this rank has no output; the batch part whose tokens are counted, or None)."""
        with self.no_sync(model, skip=not last), precision.autocast():
            out = result(step(model, batch))
        loss, count = weights.loss(out, last)
        before_backward()
        precision.backward(loss)
        return [(out.loss * count if count is not None else loss, count, out, batch)]

    def eval_batch(self, model: nn.Module, step: Callable, batch: Any, autocast: Callable) -> List[Tuple[Any, Any]]:
        """The step's results on one validation batch (no gradients), each with the batch part it is of: one,
        or none where this rank computes no loss (a pipeline's earlier stages)."""
        with autocast():
            return [(result(step(model, batch)), batch)]

    def share(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The part of the whole model's `state` (a full checkpoint's model.pt) that this rank's model holds."""
        return state

    def model_state(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The plain model's full state_dict on the CPU, for model.pt: on rank 0 (others may get an empty
        one). Collective for a sharded strategy: every rank calls it."""
        return to_cpu(self.unwrap(model).state_dict())

    def state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """The model's and the optimizer's state as this strategy keeps them (full tensors, or each rank's
        shards), keyed by the plain model's parameter names, so that any strategy can read them. Also the
        destination a checkpoint is loaded into. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(self.unwrap(model), optimizer, options=StateDictOptions(full_state_dict=not self.sharded))

    def load_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: Dict[str, Any],
                         optimizer_state: Dict[str, Any], full: bool) -> None:
        """Put saved state back: `full` tensors (a full-format checkpoint: every rank holds all of them), or
        state shaped by `state_dicts` (read from shards, which resharded it to this world). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        options = StateDictOptions(full_state_dict=full or not self.sharded, strict=True)
        if optimizer_state.get("state"):
            set_state_dict(self.unwrap(model), optimizer, model_state_dict=model_state,
                           optim_state_dict=optimizer_state, options=options)
            return
        # An optimizer that keeps no state (SGD without momentum): torch 2.13's set_state_dict cannot place
        # an empty full state ("Expected device to be set"); its groups' settings are all there is to load.
        set_model_state_dict(self.unwrap(model), model_state, options=options)
        for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def clip(self, params: List[torch.Tensor], max_norm: Optional[float]) -> torch.Tensor:
        """The gradients' total norm over every rank's share (clipped to max_norm when given), on the device."""
        # Sharded gradients (DTensors) on one mesh per group: a layer split by tensor parallelism lives on
        # (dp, tp), one FSDP alone shards on dp, and torch's norm takes one mesh at a time.
        groups: Dict[Any, List[torch.Tensor]] = {}
        for q in params:
            if q.grad is not None:
                groups.setdefault(getattr(q.grad, "device_mesh", None), []).append(q)
        norms = []
        for group in groups.values():
            norm = torch.nn.utils.get_total_norm([q.grad for q in group])
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # the same on every rank
        norm = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms)
        norm = self.whole_norm(norm)
        if max_norm:
            for group in groups.values():
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm.to(self.device, non_blocking=True)  # gradients offloaded to the CPU: the meter's device

    def whole_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The whole model's gradient norm from this rank's part's (the same where every rank holds every layer)."""
        return norm

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def max_over_ranks(self, values: List[int]) -> Callable[[], List[int]]:
        """Start taking the element-wise largest of every rank's `values` through the host (never a
        device); the returned function waits for it. Started at one check and read at the next, it
        costs the loop no wait."""
        return lambda: values

    def barrier(self) -> None:
        pass

    def checkpoint_group(self) -> Any:
        """A process group of its own for writing checkpoints in the background (None: the default one).
        Collective the first time."""
        return None

    def explain(self, error: BaseException) -> Optional[str]:
        """One line for the user when `error`, raised while training, is a mistake of the recipe that this
        strategy knows the fix for (a key to set); None for anything else, which keeps its traceback."""
        return None

    def agree(self, fn: Callable[[], T]) -> T:
        """This rank's `fn()`, once every rank has run its own; if any rank met a UserError, every rank
        raises one (rank 0's lists every rank's problems, others' prefixed with their rank). Collective.

        For the work that rank 0 alone does (its folder, its disk): the others would otherwise wait in
        the next collective for a rank that has gone."""
        try:
            result, problems = fn(), []
        except UserError as e:
            result, problems = None, e.problems
        peers.raise_any(self.all_gather_object(problems))
        return result

    def mistakes_shared(self) -> ContextManager[None]:
        """Around the run: a UserError that only this rank meets between agreements (rank 0's logger on a
        full disk) is marked in the run's store before this rank exits, and a rank whose collective then
        fails because that rank has gone stops with one line instead of a traceback."""
        return peers.shared(self.placement)

    def teardown(self) -> None:
        pass
