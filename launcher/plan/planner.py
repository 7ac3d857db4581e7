"""A recipe planned under layouts: each one's peak per rank at the recipe's micro-batch, whether it fits, the
largest micro-batch that does, and the layout to use."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

from launcher.errors import UserError
from launcher.plan import layouts as ways
from launcher.plan.fake import Layout, NotFake, Peak, micro_batches, peak


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
                "largest_micro_batch": self.largest, "problem": self.problem}


class Batches:
    """Micro-batches of any size, made of this recipe's first training items as a run collates them."""

    def __init__(self, recipe):
        from launcher.run import build

        self.train, _, _ = build.data_for(recipe.data, 1, (1, 0), recipe.seed, torch.device("cpu"), 1)
        self.items: Optional[List[Any]] = None  # a stream's first items

    def of(self, size: int) -> Any:
        if not self.train.is_stream:
            return self.train.collate(self.train.first_items(size))
        self.items = self.items or list(self.train.first_items())
        return self.train.collate(micro_batches(self.items, size))


def plan(recipe, layouts: List[Layout], memory: Optional[int], device_type: str, largest: bool = True,
         batches: Optional[Batches] = None) -> List[Row]:
    """A row per layout, in the order given."""
    batches = batches or Batches(recipe)
    rows = []
    for layout in layouts:
        row = Row(layout)
        rows.append(row)
        replicas = layout.replicas
        if recipe.data.batch_size % replicas:
            row.problem = (f"data.batch_size {recipe.data.batch_size} does not divide among its {replicas} "
                           f"data-parallel ranks")
            continue
        row.micro_batch = recipe.data.batch_size // replicas
        try:
            row.peak = peak(recipe, layout, batches.of(row.micro_batch), device_type)
            if memory is not None:
                row.fits = row.peak.total <= memory
                if largest:
                    twice = peak(recipe, layout, batches.of(2 * row.micro_batch), device_type)
                    row.largest = _largest(row.micro_batch, row.peak.total, twice.total, memory)
        except NotFake:
            raise
        except UserError as e:  # a layout this recipe's model cannot take (no tensor-parallel plan, say)
            row.problem = e.problems[0]
    return rows


def _largest(size: int, at_size: int, at_twice: int, memory: int) -> int:
    """The largest micro-batch whose peak, growing linearly with it as the two measured sizes say, fits."""
    per_item = (at_twice - at_size) / size
    fixed = at_size - per_item * size
    if fixed > memory:
        return 0
    if per_item <= 0:
        return size
    return max(0, math.floor((memory - fixed) / per_item))


def chosen(rows: List[Row]) -> Optional[Row]:
    """The layout to use: of those that fit, the one with the least communication."""
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: ways.preference(r.layout)) if fitting else None
