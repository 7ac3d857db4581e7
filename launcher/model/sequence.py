"""A batch of token rows split along the sequence for context parallelism (parallel.cp): each rank of a cp group
takes a contiguous 1/cp of every row, and the loss of its own tokens.

What must be whole-sequence is made so before the split: the labels are shifted for next-token prediction (so the
last token of one rank's part is scored against the first of the next rank's), the position ids are the whole
row's (each packed sample's own, restarting at 0), and the inputs of the attention mask (packed rows' document_ids,
a 2-D attention_mask) are kept whole for the attention (launcher/parallel/ulysses.py), which sees every position.
A length that cp does not divide is padded at the end to a multiple of cp: padding that no label scores and no
real token sees (a document of its own, -1, or masked out), so the loss and gradients are the unpadded batch's.

Each rank's step then counts its own scored labels (`shift_labels`); the loop sums the counts over the cp ranks,
as over the data-parallel ranks, so the loss is the mean over the whole batch's tokens, as one process's."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from launcher.errors import UserError
from launcher.model import packed
from launcher.model.step import IGNORE_INDEX

PADDING = {"input_ids": 0, "position_ids": 0, packed.KEY: -1, "attention_mask": 0}  # what padding holds per key


def split(batch: Any, cp: int, rank: int, labels: str = "labels") -> Tuple[Dict[str, Any], Dict[str, Optional[torch.Tensor]]]:
    """(this rank's part of `batch`, the whole rows' mask inputs: documents and valid, each [B, L] or None)."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor) \
            or batch["input_ids"].dim() != 2 or not isinstance(batch.get(labels), torch.Tensor):
        raise UserError(f"parallel.cp: splits batches of token rows (a mapping with input_ids and {labels}, "
                        f"[batch, length]) along the sequence, and a batch is {_kind(batch)}; set parallel.cp=1")
    ids = batch["input_ids"]
    rows, length = ids.shape
    part = -(-length // cp)
    pad = part * cp - length
    target = batch[labels]
    if target.shape != ids.shape:
        raise UserError(f"parallel.cp: {labels} of shape {tuple(target.shape)} beside input_ids of shape "
                        f"{tuple(ids.shape)}; a split needs one label a token")
    # shifted before the split, as transformers' causal LM loss shifts: position t is scored against t + 1
    shifted = torch.cat([target[:, 1:], target.new_full((rows, 1), IGNORE_INDEX)], dim=1)
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        positions = torch.arange(length, device=ids.device).expand(rows, length)
    whole = {"input_ids": ids, "position_ids": positions, "shift_labels": shifted}
    for key, value in batch.items():  # what else runs along the rows (a mask, document_ids, token types)
        if key not in whole and key != labels and isinstance(value, torch.Tensor) and value.shape[:2] == (rows, length):
            whole[key] = value
    if pad:
        whole = {key: _padded(key, value, pad) for key, value in whole.items()}
    mask = whole.get("attention_mask")
    inputs = {"documents": whole.pop(packed.KEY, None),
              "valid": whole.pop("attention_mask") if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None}
    mine = {key: value[:, rank * part:(rank + 1) * part].contiguous() for key, value in whole.items()}
    # the labels as they were, for the metrics (a model computes its loss only when given labels; shift_labels wins)
    target = _padded("shift_labels", target, pad) if pad else target
    mine[labels] = target[:, rank * part:(rank + 1) * part].contiguous()
    for key, value in batch.items():  # the rest as it is
        if key not in mine and key not in whole and key not in (packed.KEY, "attention_mask", labels):
            mine[key] = value
    return mine, inputs


def _padded(key: str, value: torch.Tensor, pad: int) -> torch.Tensor:
    fill = IGNORE_INDEX if key == "shift_labels" else PADDING.get(key, 0)
    extra = value.new_full((value.shape[0], pad, *value.shape[2:]), fill)
    if key == "position_ids":  # padding's positions go on from the row's last (any would do: nothing scores them)
        extra = value[:, -1:] + torch.arange(1, pad + 1, device=value.device, dtype=value.dtype)
    return torch.cat([value, extra], dim=1)


def _kind(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"a mapping of {', '.join(sorted(map(str, batch)))[:120]}"
    return f"a {type(batch).__name__}"
