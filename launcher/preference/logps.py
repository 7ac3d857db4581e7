"""The answer tokens' log-probabilities under a model, and their sums per sequence of a preference batch.

A batch (launcher.data.collate.Pairs) numbers its sequences in `sequence_ids` [rows, length]: sequence 2p is
its p-th pair's chosen answer, 2p + 1 the rejected one, -1 padding. A token t's log-probability is that of
`labels[t]` given the tokens before it (the logits at t - 1), as a causal LM's loss reads it; tokens whose label
is -100 (the prompt, padding) count for nothing. Sums run per sequence on the device (`index_add_`), so the
same pairs give the same sums whether each answer has a row of its own or several share a packed row."""

from __future__ import annotations

from typing import Tuple

import torch

IGNORE = -100


def per_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[rows, length]: at t, log p(labels[t] | tokens < t) from `logits` [rows, length, vocab]; 0 where the
    label is -100 and at t = 0. In float32 at least (bf16 logits are widened; float64 stays)."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    scores = logits[:, :-1].to(wide)
    targets = labels[:, 1:]
    taken = targets.clamp(min=0).unsqueeze(-1)
    # log_softmax's value at the label, without a [rows, length, vocab] copy of log-probabilities
    values = scores.gather(-1, taken).squeeze(-1) - torch.logsumexp(scores, dim=-1)
    values = values.masked_fill(targets == IGNORE, 0.0)
    return torch.nn.functional.pad(values, (1, 0))


def sequences(batch: dict) -> int:
    """How many sequences the batch may hold, known on the host from shapes alone (no read of a value): a row
    each where each answer has its own row; for packed rows a bound (one a token), the unused ones empty."""
    rows, length = batch["labels"].shape
    count = rows if "attention_mask" in batch and batch["attention_mask"].dim() == 2 else rows * length
    return count + count % 2


def summed(values: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor,
           count: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per sequence (`count` of them): the sum of `values` [rows, length] over its answer tokens, and how many
    answer tokens it has."""
    scored = (labels != IGNORE) & (sequence_ids >= 0)
    scored[:, 0] = False  # nothing predicts a row's first token
    # every token added, those not scored as zeros: no boolean indexing, whose output's size the host would
    # wait for (a device-to-host sync each step on a GPU)
    index = sequence_ids.clamp(min=0).reshape(-1)
    sums = values.new_zeros(count).index_add_(0, index, torch.where(scored, values, 0.0).reshape(-1))
    tokens = values.new_zeros(count).index_add_(0, index, scored.to(values.dtype).reshape(-1))
    return sums, tokens


def pairs(sums: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence values split into the chosen answers' and the rejected ones'."""
    return sums[0::2], sums[1::2]
