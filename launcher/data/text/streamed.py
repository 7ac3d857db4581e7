"""`TextStream`: TextDataset's samples as a stream, for data larger than memory. Rows are read and tokenized as
the loader asks for samples (samples.py's generators over sources.py's), never all at once: what is held is
one row, and for `text` the tokens of a row of max_len still to give and the document they are in (a .json
array and a .txt file as one document are one read each: sources.py reads those whole).

It takes TextDataset's arguments and gives its items, in its order (the files' order: a stream is not
shuffled). With `packing: true` it reads `packing_buffer` samples ahead and packs them into rows as
TextDataset packs all of its own (packing.py: best-fit decreasing, ties and row order drawn from the seed;
buffer k from seed + k * 2**32, so a first buffer that holds every sample gives TextDataset's packed rows).

The launcher reads it as any stream (launcher/data/stream.py): a global batch is consecutive items at any
world size, each rank and loader worker its share. Its `state_dict()` is where the last item handed out
leaves the rows (rows read, and tokens given of the next one; packed: where its buffer began, which buffer
it is and how many of its rows were given), so a resumed run passes over the rows read without tokenizing
them (packed: but its buffer's) and reads on from there: the items of a run that went through.

Not here: counts at start (nothing is read before training: the lines at start say the tokenizer and that
the rows are streamed), and packing's line of the padding saved."""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch.utils.data import IterableDataset

from launcher.data.text import packing as packer, preference, samples as making, sources, tokenizer as tokenizers

Place = Tuple[int, int, int, int]  # rows read, tokens of the next row given, packed: the buffer, its rows given


class TextStream(IterableDataset):
    """TextDataset's items, read as they come: `{"input_ids", "labels", "attention_mask"}` of one sample each, or
    packed rows `{"input_ids", "labels", "position_ids", "document_ids"}` (collate: launcher.data.collate.Packed);
    format preference's pairs, unpacked or rows of whole pairs, as TextDataset gives them (collate: Pairs).

    Its arguments are TextDataset's (see there; `batch_size`, `cache` and `num_proc` are taken and unused, so
    that a recipe of TextDataset's keys streams by changing `_target_` alone: a stream tokenizes as it reads),
    and:

    packing_buffer: with packing, how many samples are read ahead and packed together (held in memory)."""

    def __init__(self, tokenizer: str, files: Union[str, List[str]], format: str = "chat", max_len: int = 2048,
                 columns: Optional[Dict[str, str]] = None, template: Optional[str] = None,
                 chat_template: Optional[str] = None, loss_on: str = "answers", overlong: str = "truncate",
                 bad_rows: str = "error", packing: bool = False, seed: int = 0, split: str = "train",
                 text_rows: str = "document", batch_size: Optional[int] = None,
                 cache: Union[str, bool, None] = None, packing_buffer: int = 1000,
                 num_proc: Union[int, str] = "auto"):
        if isinstance(packing_buffer, bool) or not isinstance(packing_buffer, int) or packing_buffer < 1:
            raise ValueError(f"packing_buffer: {packing_buffer!r}: how many samples are packed together, an "
                             f"integer of 1 or more")
        making.check(format, max_len, loss_on, overlong, bad_rows, packing, text_rows, template, chat_template)
        # every name resolved once, at start: a mistake is one line before a step, and each epoch reads these
        self.files = [str(path) for path in sources.paths(files)]
        self.tokenizer = tokenizers.load(tokenizer)
        self.make, _ = making.maker(format, self.tokenizer, tokenizer, making.columns(format, columns), loss_on,
                                    template, chat_template, max_len)
        self.vocabulary: Optional[int] = None  # the model's embedding rows, which no token may reach
        self.format, self.max_len, self.overlong, self.bad_rows = format, max_len, overlong, bad_rows
        self.pairwise = format == "preference"  # each sample a pair (preference.py), packed whole
        self.split, self.text_rows = split, text_rows
        self.packing, self.seed, self.buffer = packing, seed, packing_buffer
        self.counts = making.Counts()  # of the pass under way: rows made into samples, skipped, over max_len
        self.place: Place = (0, 0, 0, 0)  # where the last item handed out leaves the rows: see state_dict
        self.resume_at: Optional[Place] = None
        named = files if isinstance(files, str) else ", ".join(map(str, files))
        self.notes = [making.tokenizer_line(self.tokenizer, tokenizer, format, self.make, chat_template),
                      f"{named}: streamed as {format}, rows read and tokenized as they come (none counted at start; "
                      f"max_len {max_len}, overlong: {overlong}, bad_rows: {bad_rows})"]
        if packing:
            self.notes.append(f"packing: {packing_buffer} samples at a time packed into rows of at most {max_len} "
                              f"tokens (packing_buffer)")

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        """The items from the start, or from the place `load_state_dict` gave (that pass only)."""
        rows, drop, buffer, given = self.resume_at or (0, 0, 0, 0)
        self.resume_at, self.counts = None, making.Counts()
        samples = self._samples(rows, drop)
        if self.packing:
            yield from self._packed(samples, (rows, drop), buffer, given)
            return
        for (rows, drop), sample in samples:
            self.place = (rows, drop, 0, 0)  # before the item goes: state_dict() is asked for once it is taken
            yield preference.item(sample, 0) if self.pairwise else making.item(sample)

    def check_vocabulary(self, rows: int) -> None:
        """Each sample is checked as it comes against the model's `rows` embedding rows (one line naming the
        row of a token beyond them); the stream does not know its tokens ahead."""
        self.vocabulary = rows

    def _samples(self, skip: int, drop: int) -> Iterator[tuple]:
        rows = sources.rows(self.files, self.split, self.text_rows)
        read = making.made(rows, self.make, self.bad_rows, self.counts, skip, vocabulary=self.vocabulary)
        if self.format == "text":
            return making.cut(read, self.max_len, drop)
        if self.pairwise:
            return preference.fit(read, self.max_len, self.overlong, self.counts)
        return making.fit(read, self.max_len, self.overlong, self.counts)

    def _packed(self, samples: Iterator[tuple], start: making.Place, buffer: int,
                given: int) -> Iterator[Dict[str, torch.Tensor]]:
        """Packed rows of `packing_buffer` samples at a time, from buffer number `buffer` (which begins at
        `start` in the rows) on, its first `given` rows passed over."""
        while True:
            held = list(itertools.islice(samples, self.buffer))
            if not held:
                return
            if self.pairwise:  # a pair's two samples planned as one, in rows of two sequences of max_len
                paired = preference.flat(held)
                plan = packer.plan(preference.lengths(paired), 2 * self.max_len, self.seed + buffer * 2 ** 32)
            else:
                plan = packer.plan([len(sample["input_ids"]) for _, sample in held], self.max_len,
                                   self.seed + buffer * 2 ** 32)
            end = held[-1][0]  # where the next buffer begins
            for number in range(given, len(plan)):
                done = number + 1 == len(plan)
                self.place = (*end, buffer + 1, 0) if done else (*start, buffer, number + 1)
                if self.pairwise:
                    yield preference.row(paired, plan[number])
                else:
                    yield making.item(packer.join([held[i][1] for i in plan[number]]), mask=False)
            start, buffer, given = end, buffer + 1, 0

    def state_dict(self) -> Dict[str, Any]:
        """Where the items handed out leave the rows: how many rows were read before the next sample's first
        token, and how many tokens of that row were given (text rows cut across documents); packed, the same
        of the buffer the next row is in, which buffer it is, and how many of its rows were given."""
        rows, drop, buffer, given = self.place
        return {"rows": rows, "drop": drop, "buffer": buffer, "given": given}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.resume_at = tuple(int(state[key]) for key in ("rows", "drop", "buffer", "given"))
