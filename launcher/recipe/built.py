"""What each section's component must be, checked as soon as it is built.

A `_target_` can name any callable, so an object of the wrong kind (a list for the optimizer, a schedule
that needs a metric) would otherwise fail with a traceback at the first step, far from its recipe key.
What the first batch reveals (the step's and metrics' outputs) is checked in `launcher.run.first_batch`.
A `_partial_: true` component is a functools.partial, callable like the function it wraps.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from launcher.errors import UserError, a_kind

# What the launcher calls each of these built components as.
CALLED = {"loss": "loss(output, target) -> a scalar",
          "step": "step(model, batch) -> a loss, or a mapping with loss",
          "data.collate": "collate(items) -> a batch"}
SCHEDULES_HELP = ("the launcher calls step() once per optimizer step with no argument, as LambdaLR, StepLR, "
                  "CosineAnnealingLR, OneCycleLR, LinearLR and SequentialLR expect; ReduceLROnPlateau needs a "
                  "metric and is not supported")


def check(key: str, target: str, built: Any) -> None:
    """Raise UserError, naming `key`, when what `target` built is not what that section needs."""
    what = a_kind(built)
    if key == "model":
        if not isinstance(built, torch.nn.Module):
            raise UserError(f"model: {target} built {what}, not a torch.nn.Module")
        if not any(p.requires_grad for p in built.parameters()):
            # Found here, before DDP refuses to wrap it or the optimizer gets an empty list.
            raise UserError(f"model: {target} has nothing to train (no parameters, or all with "
                            f"requires_grad=False); the launcher trains a model's parameters")
    elif key == "optimizer" and not isinstance(built, torch.optim.Optimizer):
        raise UserError(f"optimizer: {target} built {what}, not a torch.optim.Optimizer; name one such as "
                        f"torch.optim.AdamW (the launcher passes the parameters)")
    elif key == "lr_schedule":
        _check_schedule(target, built, what)
    elif key in CALLED or key.startswith("metrics."):
        if not callable(built):
            called = CALLED.get(key, "metric(output, target) -> per-item values")
            raise UserError(f"{key}: {target} built {what}, which cannot be called as {called}")
    elif key.startswith("data."):
        _check_dataset(key, target, built, what)


def _check_dataset(key: str, target: str, built: Any, what: str) -> None:
    # An IterableDataset may define __len__ too: it is read as a stream all the same (launcher/data/stream.py).
    if isinstance(built, torch.utils.data.IterableDataset):
        return
    if not (hasattr(built, "__getitem__") and hasattr(built, "__len__")):
        streamish = " (it iterates: subclass torch.utils.data.IterableDataset to read it as a stream)" \
            if hasattr(built, "__iter__") else ""
        raise UserError(f"{key}: {target} built {what}, not a map-style Dataset (__getitem__ and __len__) nor a "
                        f"stream (a torch.utils.data.IterableDataset){streamish}")


def _check_schedule(target: str, built: Any, what: str) -> None:
    missing = [m for m in ("step", "state_dict", "load_state_dict") if not callable(getattr(built, m, None))]
    if missing:
        raise UserError(f"lr_schedule: {target} built {what}, not an LR schedule (it has no "
                        f"{', '.join(missing)}); {SCHEDULES_HELP}")
    try:
        parameters = inspect.signature(built.step).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
        return
    needed = [p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
        raise UserError(f"lr_schedule: {target}.step() needs {', '.join(needed)}; {SCHEDULES_HELP}")
