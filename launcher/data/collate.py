"""Collating items into a batch: torch's default, the recipe's `data.collate`, and padding.

A dataset with `__getitems__` may hand out a whole batch at once: anything but a list is already a
batch and passes through untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional

import torch
from torch.utils.data import default_collate


def default(data: Any) -> Any:
    """A list of items stacked into a batch (torch's default_collate, and field by field for dataclass
    items); a batch fetched whole is already one."""
    if not isinstance(data, list):
        return data
    first = data[0] if data else None
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{f.name: default([getattr(item, f.name) for item in data])
                                             for f in dataclasses.fields(first) if f.init})
    return default_collate(data)


class Collate:
    """The recipe's `data.collate`, called on lists of items only."""

    def __init__(self, fn: Callable[[list], Any]):
        self.fn = fn

    def __call__(self, data: Any) -> Any:
        return self.fn(data) if isinstance(data, list) else data


class Pad:
    """Mapping items whose tensors differ in length along their first dimension, padded at the end to
    the longest in the batch and stacked: `values` gives the padding per key (say `labels: -100`, so
    that padding is not a target), `value` the rest (`attention_mask` gets 0, which marks padding).
    Lists of numbers (HF datasets' rows without a format) are read as tensors.
    Other fields (strings, ids) are collated as torch's default_collate does."""

    def __init__(self, values: Optional[Dict[str, Any]] = None, value: Any = 0, multiple_of: int = 1):
        self.values = dict(values or {})
        self.value = value
        self.multiple_of = multiple_of

    def __call__(self, items: list) -> Dict[str, Any]:
        if not items or not isinstance(items[0], Mapping):
            raise TypeError(f"Pad collates mapping items (dicts of tensors), got {type(items[0]).__name__ if items else 'no items'}")
        batch = {}
        for key in items[0]:
            column = [item[key] for item in items]
            if all(isinstance(c, list) and all(isinstance(v, (int, float)) for v in c) for c in column):
                column = [torch.as_tensor(c) for c in column]  # rows as HF datasets give them without a format
            if isinstance(column[0], torch.Tensor) and column[0].dim() >= 1:
                batch[key] = self._padded(column, self.values.get(key, self.value))
            else:
                batch[key] = default_collate(column)
        return batch

    def _padded(self, column: list, value: Any) -> torch.Tensor:
        longest = max(t.shape[0] for t in column)
        longest = -(-longest // self.multiple_of) * self.multiple_of
        out = column[0].new_full((len(column), longest, *column[0].shape[1:]), value)
        for row, t in zip(out, column):
            row[:t.shape[0]] = t
        return out


class Packed(Pad):
    """Rows of packed samples (launcher/data/text/packing.py: input_ids, labels, position_ids, document_ids),
    padded at the end to the longest row as Pad does: input_ids with `pad_id`, labels with -100 (no target),
    position_ids with 0, document_ids with -1 (padding is a sample of its own, which no token of the rows
    sees). The step turns document_ids into the model's attention mask (launcher/model/packed.py)."""

    def __init__(self, pad_id: int = 0, multiple_of: int = 1):
        super().__init__(values={"input_ids": pad_id, "labels": -100, "position_ids": 0, "document_ids": -1},
                         multiple_of=multiple_of)


class Pairs:
    """Preference items (launcher/data/text/preference.py: pairs unpacked, or rows of whole pairs packed) into
    one batch for the DPO family of steps:

    - `input_ids`, `labels` [R, L] (padded at the end with `pad_id` and -100), and `attention_mask` [R, L]
      (unpacked: rows 2p and 2p + 1 are the batch's p-th pair's chosen and rejected, R = 2 x pairs) or
      `position_ids` and `document_ids` (packed rows, padded as `Packed` pads them);
    - `sequence_ids` [R, L]: the sequence of the batch each token is in, numbered so that sequence 2p is the
      p-th pair's chosen and 2p + 1 its rejected (unpacked: the row; packed: a running count of the rows'
      documents over the batch), -1 at padding: what a step sums a sequence's log-probabilities by;
    - `ref_logps` [R, L] float64 (0.0 at padding), where the items carry the reference's values."""

    SIDES = ("chosen", "rejected")

    def __init__(self, pad_id: int = 0, multiple_of: int = 1):
        self.pad_id, self.multiple_of = pad_id, multiple_of

    def __call__(self, items: list) -> Dict[str, Any]:
        if not items or not isinstance(items[0], Mapping):
            raise TypeError(f"Pairs collates preference items (dicts of tensors), got "
                            f"{type(items[0]).__name__ if items else 'no items'}")
        if "document_ids" in items[0]:
            return self._packed(items)
        refs = sum("chosen_ref_logps" in item for item in items)
        if refs not in (0, len(items)):
            raise ValueError(f"Pairs: {refs} of {len(items)} items carry the reference's values; all or none do")
        rows = [{"input_ids": item[f"{side}_input_ids"], "labels": item[f"{side}_labels"],
                 "attention_mask": torch.ones_like(item[f"{side}_input_ids"]),
                 "sequence_ids": torch.full_like(item[f"{side}_input_ids"], r % 2 + 2 * p),
                 **({"ref_logps": item[f"{side}_ref_logps"]} if refs else {})}
                for p, item in enumerate(items) for r, side in enumerate(self.SIDES)]
        return self._pad(rows)

    def _packed(self, items: list) -> Dict[str, Any]:
        rows, before = [], 0
        for item in items:
            documents = int(item["document_ids"].max()) + 1 if len(item["document_ids"]) else 0
            if documents % 2:
                raise ValueError(f"Pairs: a packed row of {documents} documents; a row holds whole pairs, chosen "
                                 f"then rejected")
            rows.append({**item, "sequence_ids": item["document_ids"] + before})
            before += documents
        return self._pad(rows)

    def _pad(self, rows: list) -> Dict[str, Any]:
        return Pad(values={"input_ids": self.pad_id, "labels": -100, "attention_mask": 0, "position_ids": 0,
                           "document_ids": -1, "sequence_ids": -1, "ref_logps": 0.0},
                   multiple_of=self.multiple_of)(rows)
