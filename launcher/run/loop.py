"""The training loop. Between two log steps it never reads a tensor on the host."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from launcher.data.sampling import Position, TrainData
from launcher.errors import NoQuorum, UserError, first_line
from launcher.loggers import Console, Loggers
from launcher.run.metrics import TrainMeter, evaluate
from launcher.model.precision import Precision
from launcher.recipe.schema import TrainerConfig
from launcher.stopping import StopFlag, Stopped
from launcher.strategies import Strategy
from launcher.strategies.base import Live
from launcher.observe.watch import Watch


@dataclass
class Parts:
    model: nn.Module  # as wrapped by the strategy
    optimizer: torch.optim.Optimizer
    schedule: Optional[Any]
    step: Callable  # step(model, batch) -> loss | {loss, num_items, output, target}
    metrics: Dict[str, Callable]
    precision: Precision
    strategy: Strategy
    data: TrainData
    val: Optional[Any]  # re-iterable validation batches
    meter: TrainMeter
    logger: Loggers
    console: Console
    save: Callable[[Position, bool, bool], None]  # a checkpoint (when final, model.pt too; the last: wait for it)
    stop: StopFlag  # set by a signal; checked at step boundaries
    save_on_stop: bool = True
    idle: Callable[[], None] = lambda: None  # at log steps: finish what runs in the background (a checkpoint's write)
    watch: Watch = field(default_factory=lambda: Watch([]))  # the recipe's profiler and memory windows
    between_steps: bool = True  # False from a step's first batch until it is counted: no checkpoint then
    measured: Optional[Any] = None  # the peak memory of a step, measured (launcher/observe/memory.py)
    closing: Callable[[], Dict[str, float]] = dict  # at the last step: values to log with it (the memory peaks)


def total_steps(cfg: TrainerConfig, steps_per_epoch: int) -> int:
    limits = [cfg.max_steps, cfg.max_epochs * steps_per_epoch if cfg.max_epochs else None]
    return min(x for x in limits if x is not None)


def fit(p: Parts, cfg: TrainerConfig, save_every: Optional[int], pos: Position) -> Dict[str, float]:
    """Train from `pos` to the end; returns the last logged values (train and val)."""
    total = total_steps(cfg, p.data.steps_per_epoch)
    params = [q for q in p.model.parameters() if q.requires_grad]
    batches = p.data.stream(pos)
    weights = LossWeights(cfg.grad_accum_steps, p.strategy, params)
    p.console.start(total, pos.step)
    p.meter.start(pos.step)
    last: Dict[str, float] = {}
    p.watch.start(pos.step, total)
    live = Live(p.model, p.optimizer, p.schedule, p.precision, pos, p.data, p.console.info)
    while pos.step < total:
        if p.strategy.begin_step(live):  # this group took a live peer's state and position (fault tolerance)
            batches = _read_from(batches, p, pos)
            p.meter.start(pos.step)
            if pos.step >= total:
                break
        step = pos.step + 1
        evaluating = p.val is not None and (_due(step, cfg.eval_every) or step == total)
        saving = (_due(step, save_every) and p.strategy.writes_checkpoints()) or step == total
        # Log steps are the only places the host reads device values: a checkpoint or an
        # evaluation is one too, where the steps so far are checked for NaN (the interval goes on).
        log_step = _due(step, cfg.log_every) or step == total
        syncing = log_step or evaluating or saving
        p.between_steps = False
        began = pos.epoch, pos.batch
        try:
            lr = _train_step(p, cfg, batches, weights, params, syncing)
        except NoQuorum:  # fault tolerance: the quorum the step started with never came; the strategy put what
            p.between_steps = True  # the step moved on back as at its start (saved, whole, before the group stops)
            raise
        if lr is None:  # dropped: a replica group failed during it; trained again from the same batches
            pos.epoch, pos.batch = began
            batches = _read_from(batches, p, pos)
            p.between_steps = True
            continue
        if p.schedule is not None:
            _step_schedule(p.schedule, step)
        pos.step = step
        p.between_steps = True
        p.console.advance()
        stopping = p.stop.agreed(step, p.strategy.max_over_ranks) if step < total else None
        if stopping and p.save_on_stop:
            saving = syncing = True
        values: Dict[str, float] = {}
        if syncing:
            values = _sync_point(p, pos, total, lr, log_step or stopping, log_step, evaluating)
            last.update(values)
        if saving:  # a signal's save is written before the exit, never in the background
            began = time.perf_counter()
            p.save(pos, step == total, bool(stopping))
            blocked = time.perf_counter() - began
            p.meter.exclude(blocked)
            values["checkpoint/blocked_s"] = blocked  # what the save cost the step: its staging alone when async
        if step == total:
            values.update(p.closing())
        if values:
            p.logger.scalars(values, step)  # one call per step logged: a tracker's step holds train and val
        p.watch.at(step)
        if stopping:
            p.console.close()
            raise Stopped(stopping, step)
    p.stop.finish()
    p.console.close()
    batches.close()
    return last


def _read_from(batches, p: Parts, pos: Position):
    """The stream of micro-batches again, from `pos` (a step dropped, or a position taken from a live peer)."""
    batches.close()
    return p.data.stream(pos)


def _train_step(p: Parts, cfg: TrainerConfig, batches, weights: "LossWeights", params: list,
                syncing: bool) -> Optional[float]:
    """One optimizer step over grad_accum_steps micro-batches; the learning rate it stepped with, or None when
    the strategy dropped it (nothing stepped, nothing recorded)."""
    # Where the gradients are freed (set to None). On CUDA right after the optimizer step: the caching
    # allocator reuses the memory and the forward runs without them (a lower peak). On the CPU after
    # the first forward, as hand-written loops do: freed right after the step, they would sit at the
    # top of glibc's heap, go back to the OS and be faulted in again by the next backward.
    free_after_step = p.strategy.device.type == "cuda"
    accum = cfg.grad_accum_steps
    recorded = p.meter.mark()
    weights.start()
    for micro in range(accum):
        batch = next(batches)
        p.meter.before(batch)
        if p.measured is not None:
            p.measured.saw(batch)
        syncs = micro + 1 == accum  # the micro-batch whose backward synchronises the gradients
        zero = micro == 0 and not free_after_step
        for loss, count, out, part in p.strategy.train_batch(
                p.model, p.step, batch, p.precision, weights, syncs,
                lambda: p.optimizer.zero_grad(set_to_none=True) if zero else None):
            p.meter.add(loss, count, out, part)
    weights.finish()
    if not p.strategy.commit(params):  # before unscaling: a grad scaler's step would then expect its update
        p.meter.back_to(recorded)
        p.optimizer.zero_grad(set_to_none=True)  # the step trained again starts without them (on CUDA too)
        return None
    p.precision.unscale(p.optimizer)
    norm = p.strategy.clip(params, cfg.clip_grad_norm) if cfg.clip_grad_norm or syncing else None
    lr = p.optimizer.param_groups[0]["lr"]
    p.precision.step(p.optimizer)
    if free_after_step:
        p.optimizer.zero_grad(set_to_none=True)
    p.meter.step_done(norm, p.strategy.trained_share())
    return lr


def _sync_point(p: Parts, pos: Position, total: int, lr: float, reading: bool, log_step: bool,
                evaluating: bool) -> Dict[str, float]:
    """A step where the host reads device values: the train values since the last log step (`reading`;
    else only a NaN check before a checkpoint or an evaluation) and the evaluation, for the loggers."""
    step = pos.step
    values: Dict[str, float] = {}
    if reading:  # a stop logs what it trained since the last log step
        values = p.meter.read(p.strategy.all_reduce_mean, float(lr))  # host sync: once per interval
    else:
        p.meter.check(p.strategy.all_reduce_mean)  # no checkpoint or evaluation after a NaN
    p.idle()
    if log_step:
        p.console.progress(step, total, pos.epoch, values)
    if evaluating:
        began = time.perf_counter()
        results = evaluate(p.model, p.val, lambda model, batch: p.strategy.eval_batch(
            model, p.step, batch, p.precision.autocast), p.metrics, p.strategy.all_reduce_sum, p.strategy.device)
        p.meter.exclude(time.perf_counter() - began)
        p.console.info(f"eval at step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in results.items()))
        values = {**values, **results}
    return values


class LossWeights:
    """How each micro-batch's loss enters the gradient of one optimizer step.

    Without item counts, each micro-batch's mean loss counts alike (divided by the accumulation steps).
    With them, every item of the step counts alike, whichever micro-batch and rank holds it: the step's
    gradient is that of (sum of the items' losses) / (items on every rank). The total is known only
    after the last forward, and a sharded strategy keeps the gradients of the micro-steps out of reach
    until the last backward has reduced them, so: each micro-batch's summed loss is divided by the
    first micro-batch's count averaged over the ranks (magnitudes stay those of a mean, alike on every
    rank), and once the last backward has reduced the gradients they are rescaled to the total. With
    one micro-batch the last backward is weighted to the total directly. One all-reduce of a count per
    optimizer step (two with accumulation), on the device: no host read.
    """

    def __init__(self, accum: int, strategy: Strategy, params: list):
        self.accum, self.strategy, self.params = accum, strategy, params
        self.counted: Optional[bool] = None
        self.first = self.total = self.rescale = None

    def start(self) -> None:
        """A new optimizer step."""
        self.first = self.total = self.rescale = None

    def loss(self, out, last: bool):
        """(the loss to backward, this micro-batch's item count or None)."""
        counted = out.num_items is not None
        if self.counted is None:
            self.counted = counted
        elif counted != self.counted:
            raise UserError("step: returns num_items for some batches and not for others; count the items of "
                            "every batch, or of none")
        if not counted:
            return (out.loss / self.accum if self.accum > 1 else out.loss), None
        count = torch.as_tensor(out.num_items, device=out.loss.device).to(_count_dtype(out.loss))
        world = self.strategy.gradient_share()  # the ranks whose gradients are averaged
        if self.accum == 1:
            total = self.strategy.sum_counts(count.clone()).clamp(min=1)
            return out.loss * (count * world / total), count
        if self.first is None:  # the first micro-batch's count, summed over the ranks
            self.first, self.total = self.strategy.sum_counts(count.clone()).clamp(min=1), count
        else:
            self.total = self.total + count
        if last:  # what the reduced gradients are multiplied by: (first's sum) / (every rank's total)
            self.rescale = self.first / self.strategy.sum_counts(self.total.clone()).clamp(min=1)
        return out.loss * (count * world / self.first), count

    def summed(self, count: torch.Tensor, last: bool) -> None:
        """A micro-batch whose backward took its summed loss (a pipeline's, whose earlier stages hold no loss to
        weigh): the gradients are scaled to the step's total of items once the last one's backward is done."""
        self.total = count if self.total is None else self.total + count
        if last:
            world = self.strategy.gradient_share()
            self.rescale = world / self.strategy.sum_counts(self.total.clone()).clamp(min=1)

    def finish(self) -> None:
        """After the last backward: the accumulated, reduced gradients scaled to the step's total."""
        if self.rescale is not None:
            meshes: Dict[Any, List[torch.Tensor]] = {}  # DTensor's foreach takes one mesh at a time (ep's experts'
            for q in self.params:                       # own beside the dense parts')
                if q.grad is not None:
                    meshes.setdefault(getattr(q.grad, "device_mesh", None), []).append(q.grad)
            for grads in meshes.values():  # (gradients offloaded to the CPU get the factor there)
                torch._foreach_mul_(grads, self.rescale.to(grads[0].device, non_blocking=True))


def _count_dtype(loss: torch.Tensor) -> torch.dtype:
    """Item counts, and the weights made of them, in the loss's precision, and no less than float32."""
    return torch.promote_types(loss.dtype, torch.float32)


def _step_schedule(schedule: Any, step: int) -> None:
    try:
        schedule.step()
    except ValueError as e:  # a schedule shorter than the run, such as OneCycleLR's total_steps
        raise UserError(f"lr_schedule: fails at step {step}: {first_line(e)}; its length must cover "
                        f"trainer.max_steps (and max_epochs)") from None


def _due(step: int, every: Optional[int]) -> bool:
    return bool(every) and step % every == 0
