"""`MixtureStream`: Mixture's sources read as TextStreams and interleaved by weight, for data larger than memory.

Item j of an epoch comes from the source that block j // BLOCK gives it (mixing.py: the largest-deficit picks,
within one item of each source's share at every block's end, shuffled within the block from (seed, epoch,
block)), so the interleaving is a function of (seed, epoch, j) and each source is read in its own order. An
epoch ends once every source has been read to its end (HF datasets' `interleave_datasets(...,
stopping_strategy="all_exhausted")`): a source that ends before is read again from its start (upsampled), and
the next epoch starts every source from the start.

The launcher reads it as any stream (launcher/data/stream.py): every rank reads it whole and takes its share of
each global batch. Its `state_dict()` holds where the epoch stands (items given, each source's items of the
block so far) and each source's own place (its TextStream state: rows read), so a resumed run reads on from
there without reading the sources' rows again."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import IterableDataset

from launcher.data.text import mixing
from launcher.data.text.mixture import PER_SOURCE
from launcher.data.text.streamed import TextStream
from launcher.errors import UserError


class MixtureStream(IterableDataset):
    """Mixture's keys (tokenizer, max_len, packing, seed, batch_size shared; sources, each with its weight and
    settings), TextStream's items. With packing, each source packs `packing_buffer` of its own samples at a time
    and the weights are shares of rows. No `samples`: an epoch ends once every source has been read through."""

    def __init__(self, tokenizer: str, sources: List[Dict[str, Any]], max_len: int = 2048, seed: int = 0,
                 packing: bool = False, packing_buffer: int = 1000, batch_size: Optional[int] = None,
                 **shared: Any):
        made = mixing.specs(sources, shared, PER_SOURCE)
        self.weights = [weight for weight, _ in made]
        self.sources: List[TextStream] = []
        for i, (_, settings) in enumerate(made):
            try:
                self.sources.append(TextStream(tokenizer, max_len=max_len, seed=seed, packing=packing,
                                               packing_buffer=packing_buffer, batch_size=batch_size, **settings))
            except ValueError as e:  # a setting's mistake, said under the source's key
                raise ValueError(f"sources.{i}.{e}" if str(e).split(":")[0] in PER_SOURCE else
                                 f"sources.{i}: {e}") from None
        self.named = [mixing.named(settings) for _, settings in made]
        self.seed, self.epoch = seed, 0
        self.resume_at: Optional[Dict[str, Any]] = None
        self.place = self._start()
        self.notes = _notes(self.sources, made)

    def _start(self) -> Dict[str, Any]:
        count = len(self.sources)
        return {"items": 0, "before": [0] * count, "taken": [0] * count, "ended": [False] * count,
                "sources": [None] * count}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def check_vocabulary(self, rows: int) -> None:
        for source in self.sources:
            source.check_vocabulary(rows)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        """The epoch's items from its start, or from the place `load_state_dict` gave (that pass only)."""
        place = self.resume_at or self._start()
        self.resume_at = None
        readers = [self._reader(s, state) for s, state in enumerate(place["sources"])]
        items, before, taken, ended = place["items"], list(place["before"]), list(place["taken"]), list(place["ended"])
        # the block of the last item given (`before` is where it began), and each source's items up to it
        last = (items - 1) // mixing.BLOCK if items else 0
        picks, so_far = mixing.block(self.weights, before, self.seed, self.epoch, last), list(before)
        for s in picks[:items - last * mixing.BLOCK]:
            so_far[s] += 1
        states: List[Any] = list(place["sources"])
        while True:
            number, at = divmod(items, mixing.BLOCK)
            if at == 0 and items:
                before = list(so_far)
                picks = mixing.block(self.weights, before, self.seed, self.epoch, number)
            s = picks[at]
            item = next(readers[s], None)
            if item is None:  # the source is read through: again from its start, unless every one now is
                ended[s] = True
                if all(ended):
                    return
                readers[s], taken[s] = self._reader(s, None), 0
                item = next(readers[s], None)
                if item is None:
                    raise UserError(f"sources.{s}: {self.named[s]}: the stream gives no samples; a source of a "
                                    f"mixture gives one at least")
            taken[s], so_far[s], items = taken[s] + 1, so_far[s] + 1, items + 1
            states[s] = self.sources[s].state_dict()  # where its item leaves it: asked for once the item is taken
            self.place = {"items": items, "before": before, "taken": list(taken), "ended": list(ended),
                          "sources": list(states)}
            yield item

    def _reader(self, s: int, state: Optional[Dict[str, Any]]) -> Iterator[Any]:
        if state is not None:
            self.sources[s].load_state_dict(state)
        return iter(self.sources[s])

    def state_dict(self) -> Dict[str, Any]:
        """Where the items handed out leave the epoch: items given, each source's items before this block,
        each source's items of its pass and whether it was read through once, and each source's state."""
        return {**self.place, "before": list(self.place["before"]), "sources": list(self.place["sources"])}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        count = len(self.sources)
        if len(state.get("sources", ())) != count:
            raise UserError(f"checkpoint.resume: the checkpoint's stream mixed {len(state.get('sources', ()))} "
                            f"sources, this recipe {count}; resume with the same sources, or start over with "
                            f"checkpoint.resume=never")
        self.resume_at = {key: list(state[key]) if isinstance(state[key], (list, tuple)) else state[key]
                          for key in ("items", "before", "taken", "ended", "sources")}


def _notes(sources: List[TextStream], made) -> List[str]:
    lines = mixing.sources_lines(sources)
    whole = sum(weight for weight, _ in made)
    lines.append(f"mixture of {len(sources)} streamed sources, interleaved by weight in blocks of {mixing.BLOCK}; "
                 f"an epoch ends once every source has been read through (those that end before are read again); "
                 f"tokens not counted at start (streamed)")
    for i, (weight, settings) in enumerate(made):
        lines.append(f"sources.{i} ({mixing.named(settings)}, weight {weight:g}): {100 * weight / whole:.1f}% of "
                     f"samples")
    return lines
