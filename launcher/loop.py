"""The training loop. Between two log steps it never reads a tensor on the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from launcher.data import Position, TrainData
from launcher.errors import UserError, first_line
from launcher.loggers import Console, NullLogger
from launcher.metrics import TrainMeter, evaluate
from launcher.precision import Precision
from launcher.recipe.schema import TrainerConfig
from launcher.stopping import StopFlag, Stopped
from launcher.strategies import Strategy


@dataclass
class Parts:
    model: nn.Module  # as wrapped by the strategy
    optimizer: torch.optim.Optimizer
    schedule: Optional[Any]
    loss_fn: Callable
    metrics: Dict[str, Callable]
    precision: Precision
    strategy: Strategy
    data: TrainData
    val: Optional[Any]  # re-iterable validation batches
    meter: TrainMeter
    logger: NullLogger
    console: Console
    save: Callable[[Position, bool], None]  # a checkpoint (and, when final, model.pt); every rank calls it
    stop: StopFlag  # set by a signal; checked at step boundaries
    save_on_stop: bool = True


def total_steps(cfg: TrainerConfig, steps_per_epoch: int) -> int:
    limits = [cfg.max_steps, cfg.max_epochs * steps_per_epoch if cfg.max_epochs else None]
    return min(x for x in limits if x is not None)


def fit(p: Parts, cfg: TrainerConfig, save_every: Optional[int], pos: Position) -> Dict[str, float]:
    """Train from `pos` to the end; returns the last logged values (train and val)."""
    total = total_steps(cfg, p.data.steps_per_epoch)
    accum = cfg.grad_accum_steps
    params = [q for q in p.model.parameters() if q.requires_grad]
    # Where the gradients are freed (set to None). On CUDA right after the optimizer step: the caching
    # allocator reuses the memory and the forward runs without them (a lower peak). On the CPU after
    # the first forward, as hand-written loops do: freed right after the step, they would sit at the
    # top of glibc's heap, go back to the OS and be faulted in again by the next backward (measured:
    # twice the page faults, 5% of a compute-bound DDP step).
    free_after_step = p.strategy.device.type == "cuda"
    batches = p.data.stream(pos)
    p.console.start(total, pos.step)
    p.meter.start(pos.step)
    last: Dict[str, float] = {}
    while pos.step < total:
        step = pos.step + 1
        evaluating = p.val is not None and (_due(step, cfg.eval_every) or step == total)
        saving = _due(step, save_every) or step == total
        # Log steps are the only places the host reads device values: a checkpoint or an
        # evaluation is one too, so the interval is flushed there (and checked for NaN first).
        syncing = _due(step, cfg.log_every) or evaluating or saving
        for micro in range(accum):
            x, y = next(batches)
            with p.strategy.no_sync(p.model, skip=micro + 1 < accum), p.precision.autocast():
                output = p.model(x)
                loss = p.loss_fn(output, y)
                if accum > 1:
                    loss = loss / accum
            if micro == 0 and not free_after_step:
                p.optimizer.zero_grad(set_to_none=True)
            p.precision.backward(loss)
            p.meter.add(loss, output, y)
        p.precision.unscale(p.optimizer)
        norm = None
        if cfg.clip_grad_norm:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm)
        elif syncing:
            norm = torch.nn.utils.get_total_norm([q.grad for q in params if q.grad is not None])
        lr = p.optimizer.param_groups[0]["lr"]
        p.precision.step(p.optimizer)
        if free_after_step:
            p.optimizer.zero_grad(set_to_none=True)
        if p.schedule is not None:
            _step_schedule(p.schedule, step)
        pos.step = step
        p.meter.step_done(norm)
        p.console.advance()
        stopping = p.stop.agreed(step, p.strategy.max_over_ranks) if step < total else None
        if stopping and p.save_on_stop:
            saving = syncing = True
        if syncing:
            values = p.meter.read(p.strategy.all_reduce_mean, float(lr))  # host sync: once per interval
            p.logger.scalars(values, step)
            last.update(values)
            if _due(step, cfg.log_every) or step == total:
                p.console.progress(step, total, pos.epoch, values)
        if evaluating:
            results = evaluate(p.model, p.val, p.loss_fn, p.metrics, p.precision.autocast,
                               p.strategy.all_reduce_sum, p.strategy.device)
            p.logger.scalars(results, step)
            p.console.info(f"eval at step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in results.items()))
            last.update(results)
        if saving:
            p.save(pos, step == total)
        if stopping:
            p.console.close()
            raise Stopped(stopping, step)
    p.stop.finish()
    p.console.close()
    batches.close()
    return last


def _step_schedule(schedule: Any, step: int) -> None:
    try:
        schedule.step()
    except ValueError as e:  # a schedule shorter than the run, such as OneCycleLR's total_steps
        raise UserError(f"lr_schedule: fails at step {step}: {first_line(e)}; its length must cover "
                        f"trainer.max_steps (and max_epochs)") from None


def _due(step: int, every: Optional[int]) -> bool:
    return bool(every) and step % every == 0
