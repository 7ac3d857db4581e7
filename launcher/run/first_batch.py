"""The first batch through the step and the metrics before training, so that data that does not fit the
model is one clear line now rather than a traceback at the first step (or at the first log step).

It is fetched as training fetches it, and run in eval mode without a backward pass: no RNG is drawn
and no state changes.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from launcher.data.device import to_device
from launcher.errors import UserError, a_kind, first_line
from launcher.model import packed
from launcher.model.step import ModelLoss, Supervised, items_in, result

CAUGHT = (RuntimeError, ValueError, TypeError, IndexError)
# A metric written for another kind of output (logits expected, a ModelOutput given) fails here as an
# AttributeError or KeyError: a mismatch between the recipe's parts, not a bug in the metric.
CAUGHT_METRIC = CAUGHT + (AttributeError, KeyError)


def check(first_items: Callable[[], Any], collate: Callable, model, step, metrics: Dict[str, Callable], autocast,
          device: torch.device) -> List[str]:
    """Raise UserError when this rank's first batch (its items from `first_items()`) does not go through
    the step and metrics; returns lines for the console (what the step leaves out of the batch)."""
    try:
        batch = collate(first_items())
    except (TypeError, RuntimeError, ValueError) as e:
        raise UserError(f"data.train: items do not batch together: {first_line(e)}; a data.collate can pad or "
                        f"stack them") from None
    batch = to_device(batch, device)
    if isinstance(step, Supervised) and step.fits(batch):
        raise UserError(f"data.train: {step.fits(batch)}")
    key = "loss" if isinstance(step, Supervised) else "model" if isinstance(step, ModelLoss) else "step"
    was_training = model.training
    model.eval()
    try:
        with autocast():  # with gradients (and no backward): the loss must depend on the parameters
            returned = step(model, batch)
    except TypeError as e:
        if key != "model":
            raise _not_fitting(e, key) from None
        call = "model(**batch)" if isinstance(batch, Mapping) else "model(*batch)" if isinstance(batch, (tuple, list)) else "model(batch)"
        raise UserError(f"loss: required: without loss: the model gets the batch as {call} and must return its loss, "
                        f"but that gives TypeError: {first_line(e)}; add loss: {{_target_: ...}} (called as "
                        f"loss(model(input), target) on (input, target) batches), or a step:") from None
    except CAUGHT as e:
        raise _not_fitting(e, key) from None
    finally:
        model.train(was_training)
    out = _result(returned, step, key)
    problem = loss_problem(out.loss)
    if problem:
        raise UserError(f"{key}: {problem}")
    if out.num_items is not None and not _is_count(out.num_items):
        raise UserError(f"step: num_items must be a count (an integer or a scalar tensor), got "
                        f"{_described(out.num_items)}")
    _check_metrics(metrics, out, items_in(batch), autocast)
    if isinstance(batch, Mapping) and packed.KEY in batch:
        _check_packed(model, step, batch, autocast)
    left_out = getattr(step, "left_out", [])
    return [f"step: model(**batch) leaves out {', '.join(left_out)} (not arguments of "
            f"{type(model).__name__}.forward)"] if left_out else []


def _check_packed(model, step, batch: Mapping, autocast) -> None:
    """Packed rows: that no sample sees another in this model (two forwards more, on every rank alike)."""
    def loss_of(changed: Mapping) -> torch.Tensor:
        with autocast():
            return result(step(model, changed)).loss

    was_training = model.training
    model.eval()
    try:
        problem = packed.crossing(loss_of, batch, getattr(step, "labels", "labels"))
    finally:
        model.train(was_training)
    if problem:
        raise UserError(f"data.train: {problem}; give it an attention that takes a 4-D mask (transformers' sdpa or "
                        f"eager), or set data.train.packing: false")


def _not_fitting(e: Exception, key: str) -> UserError:
    return UserError(f"data.train does not fit the model, {'loss' if key == 'loss' else 'step'} or metrics: the "
                     f"first batch gives {type(e).__name__}: {first_line(e)}")


def _result(returned: Any, step, key: str):
    if not isinstance(returned, (torch.Tensor, Mapping)) or (isinstance(returned, Mapping) and "loss" not in returned):
        raise UserError(f"step: must return a scalar loss tensor or a mapping with loss (and optionally num_items, "
                        f"output, target), got {_described(returned)}")
    out = result(returned)
    if out.loss is None and isinstance(step, ModelLoss):
        got = _described(out.output)
        hint = " (does the batch carry labels?)" if isinstance(out.output, Mapping) else ""
        raise UserError(f"loss: required: the model returned {got} and no loss{hint}; add loss: {{_target_: ...}} "
                        f"(it gets the model's output and the batch's target), or a step:")
    return out


def _check_metrics(metrics: Dict[str, Callable], out, n: int, autocast) -> None:
    with torch.no_grad(), autocast():
        for name, fn in metrics.items():
            if out.output is None:
                raise UserError(f"metrics.{name}: the step gives no output for the metrics; a step used with metrics "
                                f"returns a mapping with loss, output and target (metric(output, target))")
            try:
                values = fn(_detached(out.output), out.target)
            except CAUGHT_METRIC as e:
                raise UserError(f"metrics.{name}: cannot read the step's output ({_described(out.output)}) and "
                                f"target ({_described(out.target)}): {type(e).__name__}: {first_line(e)}") from None
            if not (isinstance(values, torch.Tensor) and values.dim() >= 1 and values.shape[0] == n):
                got = f"shape {tuple(values.shape)}" if isinstance(values, torch.Tensor) else _described(values)
                raise UserError(f"metrics.{name}: must return one value per item, a tensor of shape ({n}, ...) "
                                f"for this batch of {n}; got {got}")


def _detached(output: Any) -> Any:
    return output.detach() if isinstance(output, torch.Tensor) else output


def loss_problem(loss: Any) -> Optional[str]:
    """What is wrong with the first batch's loss for a backward pass, or None."""
    if not isinstance(loss, torch.Tensor):
        return f"must return a scalar tensor (the mean over the batch), got {_described(loss)}"
    if loss.dim() != 0:
        return (f"must return a scalar tensor (the mean over the batch), got shape {tuple(loss.shape)} "
                f"(reduction='none'? take its mean)")
    if not loss.is_floating_point() or not loss.requires_grad:
        return (f"the {loss.dtype} it returns does not depend on the model's parameters, so it has no gradient "
                f"(argmax, .item(), .detach() or torch.tensor(...) inside the loss?)")
    return None


def _is_count(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, int) and not isinstance(value, bool)


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return "None" if value is None else a_kind(value)
