"""Packing: several tokenized samples in one row of at most `max_len` tokens, so that a batch holds rows
that are nearly full instead of samples padded to the longest.

`pack(samples, max_len, seed)` takes samples `{"input_ids": [...], "labels": [...]}` (labels -100 where
there is no loss) and returns rows of four lists of one length:

- `input_ids`: the samples' tokens one after another;
- `labels`: theirs, except the first label of each sample, which is -100. A causal LM shifts labels
  inside the model (the logits at t are scored against the label at t + 1), so in a row the first token
  of a sample would be predicted from the last token of the one before. Padded alone, that label is
  never scored either (nothing comes before it): the row scores exactly the labels the padded samples do;
- `position_ids`: 0, 1, ... restarting at each sample;
- `document_ids`: which sample of the row each token belongs to (0, 1, ...). The step turns these into an
  attention mask by which no token sees another sample (launcher/model/packed.py); the collate
  (`launcher.data.collate.Packed`) pads rows with document -1.

Which samples share a row is best-fit decreasing (as TRL's "bfd"): the longest sample first, each into
the fullest row it fits in, else a new row. Ties (equal lengths, equally full rows) and the order of the
rows are drawn from `seed` alone, so the rows are the same on every rank, at every world size and after a
resume; the sampler's (seed, epoch) order shuffles them each epoch. Samples longer than `max_len` must be
truncated or dropped before packing (and said so): one here is a bug of the caller.
"""

from __future__ import annotations

import bisect
import heapq
import random
from typing import Any, Dict, List, Mapping, Sequence

IGNORE_INDEX = -100  # a label that is not a target (torch's CrossEntropyLoss and HF's convention)


def pack(samples: Sequence[Mapping[str, Any]], max_len: int, seed: int) -> List[Dict[str, List[int]]]:
    """The samples packed into rows of at most `max_len` tokens (see the module's docstring)."""
    rows = plan([len(sample["input_ids"]) for sample in samples], max_len, seed)
    return [join([samples[i] for i in row]) for row in rows]


def plan(lengths: Sequence[int], max_len: int, seed: int) -> List[List[int]]:
    """Which samples go in each row (their indices), by best-fit decreasing; a function of its arguments alone."""
    if max_len < 1:
        raise ValueError(f"max_len must be at least 1, got {max_len}")
    for i, n in enumerate(lengths):
        if not 1 <= n <= max_len:
            raise ValueError(f"sample {i} has {n} tokens: packing takes samples of 1 to max_len ({max_len}) tokens; "
                             f"truncate or drop the others before packing")
    draw = random.Random(seed)
    tie = list(range(len(lengths)))
    draw.shuffle(tie)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], tie[i]))
    rows: List[List[int]] = []
    spaces: List[int] = []  # sorted: the free spaces some row has
    rows_with: Dict[int, List[int]] = {}  # free space -> heap of the rows that have it (the earliest first)
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(spaces, n)  # the least free space that fits: the fullest row
        if k == len(spaces):
            row, space = len(rows), max_len
            rows.append([])
        else:
            space = spaces[k]
            row = heapq.heappop(rows_with[space])
            if not rows_with[space]:
                del rows_with[space], spaces[k]
        rows[row].append(i)
        left = space - n
        if left:
            if left not in rows_with:
                rows_with[left] = []
                bisect.insort(spaces, left)
            heapq.heappush(rows_with[left], row)
    draw.shuffle(rows)
    return rows


def join(samples: Sequence[Mapping[str, Any]]) -> Dict[str, List[int]]:
    """One row of these samples: input_ids, labels (each sample's first -100), position_ids, document_ids."""
    row: Dict[str, List[int]] = {"input_ids": [], "labels": [], "position_ids": [], "document_ids": []}
    for document, sample in enumerate(samples):
        ids, labels = _ints(sample["input_ids"]), _ints(sample["labels"])
        if len(ids) != len(labels):
            raise ValueError(f"a sample has {len(ids)} input_ids and {len(labels)} labels; they must be as many")
        row["input_ids"] += ids
        row["labels"] += [IGNORE_INDEX] + labels[1:]
        row["position_ids"] += range(len(ids))
        row["document_ids"] += [document] * len(ids)
    return row


def padding(lengths: Sequence[int], rows: Sequence[Sequence[int]], max_len: int, batch_size: int, seed: int) -> str:
    """The line a dataset prints at start: the share of padding tokens in batches of `batch_size`, without
    and with packing (`rows` from `plan`), each padded to its longest as the Pad and Packed collates do."""
    unpacked = _padded_share(list(lengths), batch_size, seed)
    packed = _padded_share([sum(lengths[i] for i in row) for row in rows], batch_size, seed)
    into = f"{len(rows):,} row{'s' * (len(rows) != 1)}"
    return (f"packing: {len(lengths):,} samples into {into} of at most {max_len:,} tokens; padding in batches of "
            f"{batch_size:,}: {unpacked:.0%} of tokens without packing, {packed:.0%} packed")


def _padded_share(lengths: List[int], batch_size: int, seed: int) -> float:
    """The padding's share of the tokens in batches drawn at random (whole batches, as training takes them)."""
    random.Random(seed).shuffle(lengths)
    whole = max(len(lengths) // batch_size, 1) * batch_size
    batches = [lengths[i:i + batch_size] for i in range(0, min(whole, len(lengths)), batch_size)]
    real = sum(sum(batch) for batch in batches)
    room = sum(max(batch) * len(batch) for batch in batches)
    return 1 - real / room if room else 0.0


def _ints(values: Any) -> List[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)
