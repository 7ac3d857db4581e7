"""`Mixture`: several text sources, each a TextDataset of its own files and settings, mixed by weight into one
map-style dataset, as TRL's `dataset_mixture` and open-instruct's mixer mix theirs, but drawn anew each epoch.

An epoch is `samples` items (default: the sources' items added up). Source s gives `c_s` of them, its share of
the weights rounded by largest remainder (mixing.py), items `offset_s` to `offset_s + c_s - 1` of the epoch; which
of its rows they are is drawn from (seed, source, pass) as one endless sequence of passes over its rows, each a
fresh permutation, epoch e taking the next `c_s` draws: without replacement where the source has enough rows,
cycling through fresh permutations where it is upsampled, never the same rows every epoch where it is
downsampled. The sampler then shuffles the epoch's items as it shuffles any dataset's (data.shuffle). So item i
of epoch e is a function of (seed, e, i) alone: the loader asks for it by `at_epoch(e, i)`
(launcher/data/item_rng.py), and the mixture is the same at every world size, with any loader workers, and after
a resume.

Preference sources (pairs, pair_item, attach_reference, reference_key: the contract of issue 53) are passed
through: pairs are numbered source by source, and a reference is attached to each source's own pairs."""

from __future__ import annotations

import bisect
import hashlib
import json
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils.data import Dataset

from launcher.data.text import mixing
from launcher.data.text.dataset import TextDataset

# what the sources share and no source may change: one tokenizer, one length, packing for all
SHARED = ("tokenizer", "max_len", "packing", "seed", "batch_size")
PER_SOURCE = ("files", "format", "columns", "template", "chat_template", "loss_on", "overlong", "bad_rows", "split",
              "text_rows", "cache", "num_proc")


class Mixture(Dataset):
    """TextDataset's items, drawn from several sources by weight: `{"input_ids", "labels", "attention_mask"}`
    (or packed rows, or preference items: whatever the sources give; mix sources of one kind).

    tokenizer, max_len, packing, seed, batch_size: TextDataset's, shared by every source
    sources: a list of sources, each `{files: ..., weight: ...}` and any of TextDataset's format, columns,
        template, chat_template, loss_on, overlong, bad_rows, split, text_rows, cache, num_proc
    weight: a source's share of the samples, relative to the others' (0.7 and 0.3, or 7 and 3)
    samples: the items of an epoch (default: the sources' items added up)
    any other key of a source given here: the value of every source that does not give its own

    With packing, each source packs its own samples into rows and the weights are shares of rows."""

    def __init__(self, tokenizer: str, sources: List[Dict[str, Any]], max_len: int = 2048,
                 samples: Optional[int] = None, seed: int = 0, packing: bool = False,
                 batch_size: Optional[int] = None, **shared: Any):
        made = mixing.specs(sources, shared, PER_SOURCE)
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
            raise ValueError(f"samples: {samples!r}: the items of an epoch, a positive integer (or null: the "
                             f"sources' items added up)")
        self.weights = [weight for weight, _ in made]
        self.sources: List[TextDataset] = []
        for i, (_, settings) in enumerate(made):
            try:
                self.sources.append(TextDataset(tokenizer, max_len=max_len, seed=seed, packing=packing,
                                                batch_size=batch_size, **settings))
            except ValueError as e:  # a setting's mistake, said under the source's key
                raise ValueError(f"sources.{i}.{e}" if str(e).split(":")[0] in PER_SOURCE else
                                 f"sources.{i}: {e}") from None
        self.sizes = [len(source) for source in self.sources]
        self.total = samples if samples is not None else sum(self.sizes)
        self.counts = mixing.counts(self.weights, self.total)
        for i, count in enumerate(self.counts):
            if count == 0:
                raise ValueError(f"sources.{i}.weight: {self.weights[i]:g} gives it none of the epoch's {self.total} "
                                 f"samples; raise its weight, or samples")
        self.offsets = [sum(self.counts[:i]) for i in range(len(self.counts))]
        self.seed, self.orders = seed, mixing.Orders(seed)
        self.pad_id = self.sources[0].pad_id
        self.largest = max(source.largest for source in self.sources)
        self.notes = _notes(self.sources, made, self.counts, self.sizes, samples)
        _preference(self)

    def __len__(self) -> int:
        return self.total

    def at_epoch(self, epoch: int, index: int) -> Dict[str, torch.Tensor]:
        """Item `index` of `epoch` (validation's epoch -1 and the unkeyed read as epoch 0's)."""
        s = bisect.bisect_right(self.offsets, index) - 1
        drawn = max(epoch, 0) * self.counts[s] + index - self.offsets[s]
        return self.sources[s][self.orders.row(s, drawn, self.sizes[s])]

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < self.total:
            raise IndexError(f"index {index} of a mixture of {self.total} items")
        return self.at_epoch(0, index)

    def source_of(self, index: int) -> int:
        """Which source item `index` of any epoch comes from."""
        return bisect.bisect_right(self.offsets, index) - 1

    def check_vocabulary(self, rows: int) -> Optional[str]:
        for i, source in enumerate(self.sources):
            problem = source.check_vocabulary(rows)
            if problem:
                return f"sources.{i}: {problem}"
        return None

    # preference data, where every source is (set on the instance by _preference)
    def _pairs(self) -> int:
        return sum(source.pairs() for source in self.sources)

    def _pair_item(self, k: int) -> Any:
        s, k = _place(self._pair_starts(), k)
        return self.sources[s].pair_item(k)

    def _attach_reference(self, values: Sequence[Any]) -> None:
        starts = self._pair_starts()
        if len(values) != starts[-1]:
            raise ValueError(f"attach_reference: {len(values)} values for the mixture's {starts[-1]} pairs")
        for s, source in enumerate(self.sources):
            source.attach_reference(values[starts[s]:starts[s + 1]])

    def _reference_key(self) -> str:
        keys = [source.reference_key() for source in self.sources]
        return hashlib.sha256(json.dumps(["mixture", keys]).encode()).hexdigest()

    def _pair_starts(self) -> List[int]:
        starts = [0]
        for source in self.sources:
            starts.append(starts[-1] + source.pairs())
        return starts


def _place(starts: List[int], k: int) -> tuple:
    if not 0 <= k < starts[-1]:
        raise IndexError(f"pair {k} of a mixture of {starts[-1]} pairs")
    s = bisect.bisect_right(starts, k) - 1
    return s, k - starts[s]


def _preference(mixture: Mixture) -> None:
    """The preference contract's methods on `mixture` where every source has them; one line where some do."""
    have = [bool(getattr(source, "pairwise", False)) for source in mixture.sources]  # every TextDataset has the methods
    mixture.pairwise = all(have)
    if all(have):
        mixture.pairs, mixture.pair_item = mixture._pairs, mixture._pair_item
        mixture.attach_reference, mixture.reference_key = mixture._attach_reference, mixture._reference_key
    elif any(have):
        pairs = ", ".join(str(i) for i, has in enumerate(have) if has)
        raise ValueError(f"sources: {pairs} hold preference pairs and the others do not; mix sources of one kind "
                         f"(format: preference for all, or for none)")


def _notes(sources: List[TextDataset], made, counts: List[int], sizes: List[int], samples: Optional[int]) -> List[str]:
    """Each source's own lines under its key, then what the mixture makes of them: each source's share of an
    epoch's samples and (from its items' mean length) of its tokens."""
    total = sum(counts)
    lines = mixing.sources_lines(sources)
    per_item = [_tokens(source) for source in sources]
    tokens = [None if t is None else count * t / size for t, count, size in zip(per_item, counts, sizes)]
    all_tokens = None if None in tokens else sum(tokens)
    how = f"samples: {samples}" if samples is not None else "the sources' samples added up"
    lines.append(f"mixture of {len(sources)} sources: {total} samples an epoch ({how}), about "
                 f"{mixing.about(all_tokens)} tokens, each source's rows drawn afresh each epoch")
    for i, ((weight, settings), count, size, token) in enumerate(zip(made, counts, sizes, tokens)):
        times = count / size
        drawn = ("each once" if count == size else f"each {times:.2f} times (upsampled)" if count > size else
                 f"{count} of them (downsampled: others the next epoch)")
        token_share = "?" if all_tokens is None else mixing.share(token, all_tokens)
        lines.append(f"sources.{i} ({mixing.named(settings)}, weight {weight:g}): {count} samples an epoch "
                     f"({mixing.share(count, total)} of samples), about {mixing.about(token)} tokens ({token_share} "
                     f"of tokens); of its {size} samples {drawn}")
    return lines


def _tokens(source: TextDataset) -> Optional[float]:
    """The tokens of all of a source's items (every *input_ids of each sample), or None where it does not say."""
    held = getattr(source, "samples", None)
    if not isinstance(held, list):
        return None
    return float(sum(len(value) for sample in held for key, value in sample.items() if key.endswith("input_ids")))
