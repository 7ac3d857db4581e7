"""Training metrics kept on the device, read on the host once per log interval.

Between two reads nothing here touches a tensor's value on the host: each micro-batch appends its
detached loss (and item count) and its metric values to lists, and `read()` stacks them, makes one
reduction across ranks and one device-to-host copy. An MoE model's expert load (launcher/model/moe.py),
counted on the device by hooks as it runs, rides in that same reduction and copy.

A metric is `metric(output, target) -> per-item values` (first dimension: the batch), with the output
and target the step gives; the mean is over its values, leaving out NaN ones (how a metric says an
item, such as a padding token, is not counted).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from launcher.data.sampling import Padding
from launcher.errors import TrainingDiverged
from launcher.model.moe import ExpertLoad
from launcher.model.step import IGNORE_INDEX, Result, items_in, logits_of
from launcher.observe.throughput import Throughput


class Accuracy:
    """Per-item correctness of the arg-max prediction, for logits (..., classes), or a model output that
    holds them (`.logits`, `["logits"]`, as HF's ModelOutput), against integer targets (...). A target
    equal to `ignore_index` is not counted; `next_token: true` scores position t's prediction against
    target t+1, as a causal language model's loss does."""

    def __init__(self, ignore_index: int = IGNORE_INDEX, next_token: bool = False):
        self.ignore_index = ignore_index
        self.next_token = next_token

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output)
        if self.next_token:
            logits, target = logits[..., :-1, :], target[..., 1:]
        correct = (logits.argmax(dim=-1) == target).float()
        return correct.masked_fill(target == self.ignore_index, float("nan"))


MetricFn = Callable[[Any, Any], torch.Tensor]


class TrainMeter:
    """Per-step losses and metric values over one log interval, on the device.

    Losses are kept per optimizer step (not only summed) so that a NaN or inf is reported with the
    step it first appeared at, without a per-step host read. Each micro-batch only appends tensors to
    lists: no tensor operation per step; the interval's values are stacked and reduced when read.
    With a step that counts its items, a step's loss is the sum of its micro-batches' summed losses
    over the sum of their counts, on every rank.
    """

    def __init__(self, metrics: Dict[str, MetricFn], device: torch.device, throughput: Throughput,
                 loads: Optional[ExpertLoad] = None):
        self.metrics = metrics
        self.loads = loads  # an MoE model's tokens per expert, counted on the device as it runs (model/moe.py)
        self.throughput = throughput
        self.device = device
        self.losses: List[torch.Tensor] = []  # this interval's micro-batch losses, on the device
        self.counts: List[torch.Tensor] = []  # and their item counts, when the step gives them
        self.values: List[List[torch.Tensor]] = [[] for _ in metrics]  # per metric, per micro-batch values
        self.marks: List[Tuple[torch.Tensor, bool]] = []  # where a batch's real tokens are (`_marks`), counted at read
        self.first_step = 0  # the last step before this interval: its k-th loss is step first_step + k + 1
        self.steps = 0  # steps recorded since the last read
        self.trained = 0.0
        self.checked = 0  # of which checked for NaN at a save or an evaluation
        self.grad_norm: Optional[torch.Tensor] = None
        self.clock = time.perf_counter()

    def before(self, batch: Any) -> None:
        """A micro-batch about to be trained: an MoE model's expert load counts its real tokens alone, as tokens/s
        does (`_marks`: packed rows' document_ids, or a 2-D attention_mask)."""
        if self.loads is not None:
            self.loads.tokens(_marks(batch))

    def add(self, loss: torch.Tensor, count: Optional[torch.Tensor], out: Optional[Result], batch: Any = None) -> None:
        """One micro-batch: `loss` is its summed loss when `count` is given, else its mean already
        divided by the accumulation steps. A batch of token rows (input_ids with an attention_mask, or packed
        rows' document_ids) is kept by reference, and its real tokens counted at the read: tokens/s."""
        self.losses.append(loss.detach())
        if count is not None:
            self.counts.append(count)
        marks = _marks(batch)
        if marks is not None:
            self.marks.append(marks)
        if self.metrics and out is not None:  # None: this rank computes no output (a pipeline's earlier stage)
            with torch.no_grad():
                for i, fn in enumerate(self.metrics.values()):
                    self.values[i].append(fn(out.output, out.target))

    def mark(self) -> tuple:
        """Where the interval's records stand now: `back_to` forgets what a dropped step recorded after it."""
        loads = self.loads.mark() if self.loads is not None else None
        return len(self.losses), len(self.counts), len(self.marks), [len(v) for v in self.values], loads

    def back_to(self, mark: tuple) -> None:
        losses, counts, marks, values, loads = mark
        del self.losses[losses:], self.counts[counts:], self.marks[marks:]
        for kept, recorded in zip(values, self.values):
            del recorded[kept:]
        if loads is not None:
            self.loads.back_to(loads)

    def start(self, step: int) -> None:
        """Training starts (or resumes) after `step`: the first interval's clock starts now."""
        self._reset(step)

    def step_done(self, grad_norm: Optional[torch.Tensor], trained: float = 1.0) -> None:
        """A step committed, having trained `trained` of its global batch (less where replica groups were down)."""
        self.steps += 1
        self.trained += trained
        if grad_norm is not None:
            self.grad_norm = grad_norm

    def check(self, all_reduce_mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Before a save or an evaluation between log steps: raises TrainingDiverged if a step since the
        last check has a non-finite loss on any rank (one all-reduce and host read, of those steps'
        losses alone). The interval goes on: its values are still read whole at the log step, so what is
        logged does not depend on when checkpoints and evaluations happen."""
        n, done = self.steps, self.checked
        if n == done:
            return
        new = torch.stack(self.losses).float().view(n, -1).sum(1)[done:]
        losses = all_reduce_mean(new).tolist()  # device -> host: at a save or an evaluation only
        self.checked = n
        for k, value in enumerate(losses):
            if not math.isfinite(value):
                raise TrainingDiverged(f"the training loss is {value} at step {self.first_step + done + k + 1}")

    def exclude(self, seconds: float) -> None:
        """Time spent outside training (an evaluation, a save) leaves the interval's rates."""
        self.clock += seconds

    def read(self, all_reduce_mean: Callable[[torch.Tensor], torch.Tensor], lr: float) -> Dict[str, float]:
        """The interval's means across ranks. This is the one host sync of the interval."""
        n = self.steps
        empty = torch.zeros(0, device=self.device)
        per_step = torch.stack(self.losses).float().view(n, -1).sum(1) if n else empty  # micro-batches summed
        counts = torch.stack(self.counts).float().view(n, -1).sum(1) if n and self.counts else empty
        metric_sums = [_sum_and_count(v, self.device) for v in self.values]
        grad = self.grad_norm.reshape(1).float() if self.grad_norm is not None else empty
        tokens = _real_tokens(self.marks, self.device) if self.marks else empty
        loads = self.loads.packed() if self.loads is not None else empty
        packed = all_reduce_mean(torch.cat([per_step, counts, *metric_sums, tokens, loads, grad]))
        values = packed.tolist()  # device -> host: the only read between log steps
        seconds = time.perf_counter() - self.clock
        losses, at = values[:n], n
        if self.counts:  # summed losses over item counts (the same ratio as of the sums across ranks)
            losses, at = [s / c if c else s for s, c in zip(losses, values[n:2 * n])], 2 * n
        for k, value in enumerate(losses):
            if not math.isfinite(value):
                raise TrainingDiverged(f"the training loss is {value} at step {self.first_step + k + 1}")
        out = {"train/loss": sum(losses) / max(n, 1), "train/lr": lr}
        for i, name in enumerate(self.metrics):
            total, count = values[at + 2 * i], values[at + 2 * i + 1]
            out[f"train/{name}"] = total / count if count else float("nan")
        if self.grad_norm is not None:
            out["train/grad_norm"] = values[-1]
        rows = sum(tensor.shape[0] for tensor, _ in self.marks)  # this rank's: as many on every rank
        real = values[at + 2 * len(self.metrics)] / rows if rows else None  # real tokens a sample (a row)
        out.update(self.throughput.values(n, seconds, real, self.trained))
        if self.loads is not None:
            first = at + 2 * len(self.metrics) + tokens.numel()
            out.update(self.loads.values(values[first:first + loads.numel()]))
        self._reset(self.first_step + n)
        return out

    def _reset(self, first_step: int) -> None:
        self.losses, self.counts, self.marks = [], [], []
        self.values = [[] for _ in self.metrics]
        self.first_step, self.steps, self.checked, self.grad_norm = first_step, 0, 0, None
        self.trained = 0.0  # global batches trained since the last read (a step trained by some groups: a part)
        if self.loads is not None:  # what a first batch's check routed before training is not counted either
            self.loads.reset()
        self.clock = time.perf_counter()


def _marks(batch: Any) -> Optional[Tuple[torch.Tensor, bool]]:
    """Where a batch's real (not padding) tokens are: packed rows' document_ids (>= 0), or the 2-D
    attention_mask of a batch of input_ids (ones); None for other batches, whose items are samples alone."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        return None
    documents, mask = batch.get("document_ids"), batch.get("attention_mask")
    if isinstance(documents, torch.Tensor):
        return documents, True
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask, False
    return None


def _real_tokens(marks: List[Tuple[torch.Tensor, bool]], device: torch.device) -> torch.Tensor:
    """The real tokens of an interval's batches on this rank, as a 1-element float tensor: a sum per batch,
    run at the read (no operation per step)."""
    sums = [(tensor >= 0).sum() if documents else tensor.sum() for tensor, documents in marks]
    return torch.stack(sums).to(device=device, dtype=torch.float64).sum().reshape(1).float()


def _sum_and_count(values: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[sum, count] of the values that are not NaN."""
    if not values:
        return torch.zeros(2, device=device)
    flat = torch.cat([v.reshape(-1) for v in values]).float()
    return torch.stack([flat.nansum(), (~flat.isnan()).sum().float()])


@torch.no_grad()
def evaluate(model, batches, results: Callable[[Any, Any], List[Tuple[Result, Any]]], metrics: Dict[str, MetricFn],
             all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> Dict[str, float]:
    """Loss and metrics over a whole validation set, weighted by items; one host read at the end. `results(model,
    batch)` runs the step: its results, each with the part of the batch it is of (none on a rank without a loss)."""
    was_training = model.training
    model.eval()
    # [loss sum, items, (metric sum, count) ...], in float64: the value does not depend on how the items were
    # batched and shared among ranks beyond float64's rounding
    sums = torch.zeros(2 + 2 * len(metrics), device=device, dtype=torch.float64)
    for batch in batches:
        if isinstance(batch, Padding):  # run for its collectives alone (launcher/data/sampling.py: ShardSampler)
            results(model, batch.batch)
            continue
        for out, part in results(model, batch):
            n = out.num_items if out.num_items is not None else items_in(part)
            sums[0].add_(out.loss.detach().double() * n)
            sums[1].add_(n)
            for i, fn in enumerate(metrics.values(), start=1):
                sums[2 * i:2 * i + 2].add_(_sum_and_count([fn(out.output, out.target)], device))
    model.train(was_training)
    totals = all_reduce_sum(sums).tolist()  # host sync: once per evaluation, at its end
    scores = {"val/loss": totals[0] / totals[1] if totals[1] else float("nan")}
    for i, name in enumerate(metrics, start=1):
        scores[f"val/{name}"] = totals[2 * i] / totals[2 * i + 1] if totals[2 * i + 1] else float("nan")
    return scores
