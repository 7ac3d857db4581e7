"""A recipe planned under layouts: each one's peak per rank at the recipe's micro-batch, whether it fits, the
largest micro-batch that does, and the layout to use."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from launcher.errors import UserError
from launcher.plan import layouts as ways
from launcher.plan.fake import NotFake, Peak
from launcher.plan.layouts import Layout
from launcher.plan.peaks import peaks


@dataclass
class Row:
    layout: Layout
    micro_batch: Optional[int] = None  # items per rank and micro-step: data.batch_size / the data-parallel ranks
    peak: Optional[Peak] = None
    fits: Optional[bool] = None  # within the memory given (None: none given)
    largest: Optional[int] = None  # the largest micro-batch per rank that fits, found from two sizes' peaks
    problem: Optional[str] = None  # why the recipe cannot run under this layout
    notes: List[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"layout": self.layout.name, "overrides": self.layout.overrides(), "micro_batch": self.micro_batch,
                "peak_bytes": self.peak.total if self.peak else None,
                "by_kind": self.peak.by_kind if self.peak else None, "fits": self.fits,
                "largest_micro_batch": self.largest, "problem": self.problem, "assumes": self.layout.assumes()}


class Batches:
    """Micro-batches of any size, made of this recipe's training items as a run collates them: the longest of its
    first items (where items differ in length, padded to the longest in a batch, the peak is that of the batch
    of the longest items: so is the plan's). Given a `length` (a run's measured batch, padded), that long."""

    def __init__(self, recipe, length: Optional[int] = None):
        from launcher.run import build

        self.train, _, _ = build.data_for(recipe.data, 1, (1, 0), recipe.seed, torch.device("cpu"), 1)
        self.items: Optional[List[Any]] = None  # a stream's first items
        self.length = length

    def of(self, size: int) -> Any:
        return _as_long(self._longest(size), self.length)

    def _longest(self, size: int) -> Any:
        if self.train.is_stream:
            self.items = self.items or list(self.train.first_items())
            return self.train.collate(micro_batches(_longest(self.items, len(self.items)), size))
        fetched = self.train.first_items(max(size, LOOKED_AT))
        if not isinstance(fetched, list):  # a batch fetched whole (a TensorDataset's): its items are alike
            return self.train.collate(self.train.first_items(size))
        return self.train.collate(_longest(fetched, size))


LOOKED_AT = 64  # items read for the longest


def _as_long(batch: Any, length: Optional[int]) -> Any:
    """`batch` with its padded length (memory.padded_length) `length`: the tensors that long cut to it, or
    repeated along it (a fake step's memory is its shapes')."""
    from torch.utils._pytree import tree_map

    from launcher.observe.memory import padded_length

    longest = padded_length(batch)
    if length is None or longest is None or length == longest:
        return batch

    def fitted(t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == longest):
            return t
        return t.repeat(1, math.ceil(length / longest), *[1] * (t.dim() - 2))[:, :length].contiguous()

    return tree_map(fitted, batch)


def micro_batches(items: List[Any], size: int) -> List[Any]:
    """`size` items from a rank's first ones, repeated as often as needed: a micro-batch of that size."""
    return (items * math.ceil(size / len(items)))[:size]


def _longest(items: List[Any], size: int) -> List[Any]:
    """The `size` items holding the most tensor elements (repeated where there are fewer), in their order."""
    from torch.utils._pytree import tree_flatten

    def elements(item: Any) -> int:
        return sum(t.numel() for t in tree_flatten(item)[0] if isinstance(t, torch.Tensor))

    ranked = sorted(range(len(items)), key=lambda i: -elements(items[i]))[:size]
    return micro_batches([items[i] for i in sorted(ranked)], size)


def plan(recipe, layouts: List[Layout], memory: Optional[int], device_type: str, largest: bool = True,
         batches: Optional[Batches] = None, jobs: Optional[int] = None) -> List[Row]:
    """A row per layout, in the order given. Layouts are planned side by side, in processes of their own, `jobs`
    at once (default: as many as there are CPUs; 1: one after another, in this process)."""
    batches = batches or Batches(recipe)
    rows, work = [], []
    for layout in layouts:
        row = Row(layout)
        rows.append(row)
        replicas = layout.replicas
        if recipe.data.batch_size % replicas:
            row.problem = (f"data.batch_size {recipe.data.batch_size} does not divide among its {replicas} "
                           f"data-parallel ranks")
            continue
        row.micro_batch = recipe.data.batch_size // replicas
        sizes = [row.micro_batch] + ([2 * row.micro_batch] if memory is not None and largest else [])
        work.append((row, [batches.of(size) for size in sizes]))
    done = list(zip(work, _side_by_side(recipe, work, device_type, jobs)))
    failed = [problem for _, (_, problem) in done if isinstance(problem, NotFake)]
    if failed and all(found is None for _, (found, _) in done):  # nothing planned, for the step: one line
        raise failed[0]
    for (row, _), (found, problem) in done:
        if problem is not None:  # a layout this recipe's model cannot take (no tensor-parallel plan, a step that
            row.problem = problem.row if isinstance(problem, NotFake) else problem  # fails recomputed)
            continue
        row.peak = found[0]
        if memory is not None:
            row.fits = row.peak.total <= memory
            if len(found) > 1:
                row.largest = _largest(row.micro_batch, found[0], found[1], memory)
    return rows


def _side_by_side(recipe, jobs: list, device_type: str, workers: Optional[int]) -> list:
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    if workers <= 1:
        return [_planned(recipe, row.layout, sized, device_type) for row, sized in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_planned, [recipe] * len(jobs), [row.layout for row, _ in jobs],
                             [sized for _, sized in jobs], [device_type] * len(jobs)))


def _planned(recipe, layout: Layout, sized: list, device_type: str) -> tuple:
    """(the peaks, None) or (None, why not): what a worker sends back."""
    try:
        return peaks(recipe, layout, sized, device_type), None
    except NotFake as e:
        return None, e
    except UserError as e:
        return None, e.problems[0]


def _largest(size: int, at_size: Peak, at_twice: Peak, memory: int) -> int:
    """The largest micro-batch that fits: the peak of forward and backward grows linearly with it (as the two
    sizes planned say); the optimizer's step, where it peaks higher, does not."""
    if at_size.total > at_size.running and at_size.total > memory:
        return 0  # the optimizer's step alone does not fit
    per_item = (at_twice.running - at_size.running) / size
    fixed = at_size.running - per_item * size
    if fixed > memory:
        return 0
    if per_item <= 0:
        return size
    return max(0, math.floor((memory - fixed) / per_item))


def chosen(rows: List[Row]) -> Optional[Row]:
    """The layout to use: of those that fit, the one with the least communication."""
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: ways.preference(r.layout)) if fitting else None


def size(text: str, key: str) -> int:
    """Bytes from a size as people write it: 80GB, 24GiB, 500MB, or a number of bytes."""
    import re

    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"{key} {text}: give one device's memory, such as 80GB, 24GiB or 1000000000 (bytes)")
    return int(float(match.group(1)) * units[match.group(2) or ""])


def own_layout(recipe, devices: int) -> Optional[Layout]:
    """The layout a run of this recipe has on `devices` devices, or None for one the planner does not plan
    (dp, accelerate, parallel.cp)."""
    strategy = recipe.strategy if recipe.strategy != "auto" else "single" if devices == 1 else "ddp"
    if recipe.parallel.cp > 1:  # not planned yet
        return None
    if strategy == "fsdp":
        return Layout("fsdp", devices, recipe.parallel.tp, recipe.parallel.dp_replicate, ep=recipe.parallel.ep)
    if strategy in ("single", "ddp"):
        return Layout(strategy, devices if strategy == "ddp" else 1)
    return None
