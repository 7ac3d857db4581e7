"""Preference pairs (pairs.py makes them from rows) as a dataset's items, for the DPO family of steps.

A pair is two samples that share their prompt: prompt + chosen, prompt + rejected, each with its labels on
its answer alone. `max_len` applies to each of them (`fit`): a pair with a sequence over it is truncated at it
or dropped (`overlong`), and one truncated to no answer token on either side is dropped (a DPO loss needs
both answers' log-probabilities); both are counted, as SFT's samples are. The dataset keeps its pairs as
samples two by two, chosen then rejected (what the token cache stores: `flat`).

An item is one pair unpacked (`item`): `chosen_input_ids`, `chosen_labels`, `rejected_input_ids`,
`rejected_labels` (LongTensors); or, packed, one row of several whole pairs (`row`) as packing.join makes
rows (`input_ids`, `labels`, `position_ids`, `document_ids`), its documents in order pair 0's chosen, pair 0's
rejected, pair 1's chosen, ...: document 2k and 2k + 1 are the row's k-th pair. The packer plans by the pair's
length (chosen + rejected) in rows of 2 x max_len, so that any pair fits whole and none is split.

Once a reference is attached (`checked`: a pair's values per token of each sequence, aligned with its labels:
at token t, log p_ref(labels[t] | the tokens before t), 0.0 where labels[t] is -100), an unpacked item also
holds `chosen_ref_logps` and `rejected_ref_logps`, a packed row `ref_logps` (its pairs' values end to end,
which a document's first label, -100 in the row, leaves at 0.0 as it is at t = 0 unpacked): Float64."""

from __future__ import annotations

import random
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from launcher.data.text import packing as packer
from launcher.data.text.formats import IGNORE, Sample
from launcher.data.text.pairs import Pair
from launcher.data.text.samples import Counts, Place

SIDES = ("chosen", "rejected")
Reference = List[Tuple[torch.Tensor, torch.Tensor]]


def fit(pairs: Iterable[tuple], max_len: int, overlong: str, counts: Counts) -> Iterator[Tuple[Place, Pair]]:
    """The pairs whose sequences fit max_len (truncated ones too, with overlong: truncate), each with its place;
    counted where a sequence did not (`counts.over`), and where truncation left either side no answer token
    (`counts.lost`, dropped)."""
    for read, pair in pairs:
        if any(len(sample["input_ids"]) > max_len for sample in pair):
            counts.over += 1
            if overlong == "drop":
                continue
            pair = tuple({key: value[:max_len] for key, value in sample.items()} for sample in pair)
            if any(all(label == IGNORE for label in sample["labels"][1:]) for sample in pair):
                counts.lost += 1  # the first token is never predicted, so its label never counts
                continue
        yield (read, 0), pair


def flat(pairs: Iterable[tuple]) -> List[Sample]:
    """The pairs' samples two by two, chosen then rejected."""
    return [sample for _, pair in pairs for sample in pair]


def lengths(samples: Sequence[Sample]) -> List[int]:
    """Each pair's tokens, chosen and rejected: what the packer plans by."""
    return [len(samples[i]["input_ids"]) + len(samples[i + 1]["input_ids"]) for i in range(0, len(samples), 2)]


def item(samples: Sequence[Sample], k: int, reference: Optional[Reference] = None) -> Dict[str, torch.Tensor]:
    """Pair k unpacked, with its reference values where they are attached."""
    out = {}
    for side, sample in zip(SIDES, samples[2 * k:2 * k + 2]):
        out[f"{side}_input_ids"] = torch.tensor(sample["input_ids"], dtype=torch.long)
        out[f"{side}_labels"] = torch.tensor(sample["labels"], dtype=torch.long)
    if reference is not None:
        out["chosen_ref_logps"], out["rejected_ref_logps"] = reference[k]
    return out


def row(samples: Sequence[Sample], pairs: Sequence[int],
        reference: Optional[Reference] = None) -> Dict[str, torch.Tensor]:
    """Those pairs packed in one row, each whole: documents 2k, 2k + 1 the k-th pair's chosen and rejected."""
    out = {key: torch.tensor(value, dtype=torch.long)
           for key, value in packer.join([samples[2 * k + side] for k in pairs for side in (0, 1)]).items()}
    if reference is not None:
        out["ref_logps"] = torch.cat([values for k in pairs for values in reference[k]])
    return out


def checked(samples: Sequence[Sample], values: Sequence[Any]) -> Reference:
    """The reference values as items hold them (Float64, on the CPU), one pair of sequences for each pair and
    each as long as its sample, or ValueError: a reference of other tokens is a bug of whoever computed it."""
    pairs = len(samples) // 2
    if len(values) != pairs:
        raise ValueError(f"attach_reference: {len(values)} pairs of values for {pairs} pairs")
    out = []
    for k, given in enumerate(values):
        if len(given) != 2:
            raise ValueError(f"attach_reference: pair {k} has {len(given)} sequences of values, not 2 (chosen, "
                             f"rejected)")
        pair = tuple(torch.as_tensor(v).detach().to("cpu", torch.float64).reshape(-1) for v in given)
        for side, tensor, sample in zip(SIDES, pair, samples[2 * k:2 * k + 2]):
            if len(tensor) != len(sample["input_ids"]):
                raise ValueError(f"attach_reference: pair {k}'s {side} has {len(tensor)} values and "
                                 f"{len(sample['input_ids'])} tokens; one value a token, aligned with its labels")
        out.append(pair)
    return out


def summary(named: str, rows: int, samples: Sequence[Sample]) -> str:
    """'pairs.jsonl: 40 rows as preference -> 40 pairs, chosen of 30 to 61 tokens, rejected of 31 to 64,
    3650 tokens, 24% of them targets (loss_on: answers)'."""
    sides = [[len(s["input_ids"]) for s in samples[side::2]] for side in (0, 1)]
    tokens = sum(map(sum, sides))
    targets = sum(label != IGNORE for s in samples for label in s["labels"][1:])  # the first is never predicted
    return (f"{named}: {rows} row{'s' * (rows != 1)} as preference -> {len(samples) // 2} "
            f"pair{'s' * (len(samples) != 2)}, chosen of {min(sides[0])} to {max(sides[0])} tokens, rejected of "
            f"{min(sides[1])} to {max(sides[1])}, {tokens} tokens, {100 * targets / max(tokens, 1):.0f}% of them "
            f"targets (loss_on: answers)")


def overlong(counts: Dict[str, Any], max_len: int, overlong: str) -> List[str]:
    """The line on the pairs with a sequence over max_len, where there are any."""
    over, lost = counts["over"], counts["lost"]
    if not over:
        return []
    then = f"truncated at it{f' ({lost} of them, left with no answer token on a side, dropped)' if lost else ''}"
    return [f"{over} of {counts['rows']} pairs with a sequence (prompt + chosen, prompt + rejected) longer than "
            f"max_len {max_len} tokens: {then if overlong == 'truncate' else 'dropped'} (overlong: {overlong})"]


def padding(samples: Sequence[Sample], rows: Sequence[Sequence[int]], room: int, batch_size: int, seed: int) -> str:
    """The line a packed preference dataset says at start: the share of padding in batches of `batch_size`,
    unpacked (each pair's two sequences a row, padded to the batch's longest) and packed (rows of pairs)."""
    sides = [(len(samples[i]["input_ids"]), len(samples[i + 1]["input_ids"])) for i in range(0, len(samples), 2)]
    unpacked = _padded([[*pair] for pair in sides], batch_size, seed)
    packed = _padded([[sum(map(sum, (sides[k] for k in r)))] for r in rows], batch_size, seed)
    return (f"packing: {len(sides):,} pairs into {len(rows):,} row{'s' * (len(rows) != 1)} of at most {room:,} "
            f"tokens (two of max_len: a pair is never split); padding in batches of {batch_size:,}: "
            f"{unpacked:.0%} of tokens without packing, {packed:.0%} packed")


def _padded(items: List[List[int]], batch_size: int, seed: int) -> float:
    """The padding's share of the tokens in whole batches of items drawn at random, each item's sequences a
    row padded to the batch's longest."""
    random.Random(seed).shuffle(items)
    whole = max(len(items) // batch_size, 1) * batch_size
    batches = [items[i:i + batch_size] for i in range(0, min(whole, len(items)), batch_size)]
    real = sum(n for batch in batches for item in batch for n in item)
    room = sum(max(n for item in batch for n in item) * sum(len(item) for item in batch) for batch in batches)
    return 1 - real / room if room else 0.0
