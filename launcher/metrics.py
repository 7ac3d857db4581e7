"""Training metrics kept on the device, read on the host once per log interval.

Between two reads nothing here touches a tensor's value on the host: each micro-batch
appends its detached loss and metric sums to lists, and `read()` stacks them, makes one
reduction across ranks and one device-to-host copy.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional

import torch

from launcher.errors import TrainingDiverged
from launcher.throughput import Throughput


class Accuracy:
    """Per-item correctness of the arg-max prediction, for logits (..., classes) and integer targets (...)."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.argmax(dim=-1) == target).float()


MetricFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TrainMeter:
    """Per-step losses and metric sums over one log interval, on the device.

    Losses are kept per optimizer step (not only summed) so that a NaN or inf is
    reported with the step it first appeared at, without a per-step host read. Each
    micro-batch only appends its detached loss (and metric sums) to a list: no tensor
    operation per step; the interval's values are stacked and reduced when read.
    """

    def __init__(self, metrics: Dict[str, MetricFn], device: torch.device, throughput: Throughput):
        self.metrics = metrics
        self.throughput = throughput
        self.device = device
        self.losses: List[torch.Tensor] = []  # this interval's micro-batch losses, on the device
        self.sums: List[List[torch.Tensor]] = [[] for _ in metrics]  # per metric, per micro-batch sums
        self.counts: List[int] = [0] * len(metrics)  # element counts are shapes: known on the host
        self.first_step = 0  # the last step before this interval: its k-th loss is step first_step + k + 1
        self.steps = 0  # steps recorded since the last read
        self.grad_norm: Optional[torch.Tensor] = None
        self.clock = time.perf_counter()

    def add(self, loss: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        """One micro-batch: `loss` is already divided by the accumulation steps."""
        self.losses.append(loss.detach())
        if self.metrics:
            with torch.no_grad():
                for i, fn in enumerate(self.metrics.values()):
                    values = fn(output.detach(), target)
                    self.sums[i].append(values.sum())
                    self.counts[i] += values.numel()

    def start(self, step: int) -> None:
        """Training starts (or resumes) after `step`: the first interval's clock starts now."""
        self._reset(step)

    def step_done(self, grad_norm: Optional[torch.Tensor]) -> None:
        self.steps += 1
        if grad_norm is not None:
            self.grad_norm = grad_norm

    def read(self, all_reduce_mean: Callable[[torch.Tensor], torch.Tensor], lr: float) -> Dict[str, float]:
        """The interval's means across ranks. This is the one host sync of the interval."""
        n = self.steps
        empty = torch.zeros(0, device=self.device)
        per_step = torch.stack(self.losses).float().view(n, -1).sum(1) if n else empty  # micro-batches summed
        sums = [torch.stack(s).float().sum().reshape(1) if s else empty.new_zeros(1) for s in self.sums]
        grad = self.grad_norm.reshape(1).float() if self.grad_norm is not None else empty
        packed = all_reduce_mean(torch.cat([per_step, *sums, grad]))
        values = packed.tolist()  # device -> host: the only read between log steps
        seconds = time.perf_counter() - self.clock
        losses, sums = values[:n], values[n:n + len(self.sums)]
        for k, value in enumerate(losses):
            if not math.isfinite(value):
                raise TrainingDiverged(f"the training loss is {value} at step {self.first_step + k + 1}")
        out = {"train/loss": sum(losses) / max(n, 1), "train/lr": lr}
        for i, name in enumerate(self.metrics):
            # Every rank sees the same number of items, so the mean of the per-rank means is the global mean.
            out[f"train/{name}"] = sums[i] / max(self.counts[i], 1)
        if self.grad_norm is not None:
            out["train/grad_norm"] = values[-1]
        out.update(self.throughput.values(n, seconds))
        self._reset(self.first_step + n)
        return out

    def _reset(self, first_step: int) -> None:
        self.losses = []
        self.sums = [[] for _ in self.metrics]
        self.counts = [0] * len(self.metrics)
        self.first_step, self.steps, self.grad_norm = first_step, 0, None
        self.clock = time.perf_counter()


@torch.no_grad()
def evaluate(model, batches, loss_fn, metrics: Dict[str, MetricFn], autocast,
             all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> Dict[str, float]:
    """Loss and metrics over a whole validation set, weighted by items; one host read at the end."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(1 + len(metrics), device=device)
    counts = [0] * (1 + len(metrics))
    for x, y in batches:
        with autocast():
            out = model(x)
            loss = loss_fn(out, y)
        sums[0].add_(loss.detach().float() * y.shape[0])
        counts[0] += y.shape[0]
        for i, fn in enumerate(metrics.values(), start=1):
            values = fn(out, y)
            sums[i].add_(values.sum())
            counts[i] += values.numel()
    model.train(was_training)
    packed = torch.cat([sums, torch.tensor(counts, dtype=sums.dtype, device=device)])
    totals = all_reduce_sum(packed).tolist()  # host sync: once per evaluation, at its end
    n = len(counts)
    result = {"val/loss": totals[0] / max(totals[n], 1)}
    for i, name in enumerate(metrics, start=1):
        result[f"val/{name}"] = totals[i] / max(totals[n + i], 1)
    return result
