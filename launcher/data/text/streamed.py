"""`TextStream`: TextDataset's samples as a stream, for data larger than memory. Rows are read and tokenized as
the loader asks for samples (samples.py's generators over sources.py's), never all at once: what is held is
one row, and for `text` the tokens of a row of max_len still to give and the document they are in.

It takes TextDataset's arguments and gives its samples, in its order (the files' order: a stream is not
shuffled), as the same items. The launcher reads it as any stream (launcher/data/stream.py): a global batch
is consecutive samples at any world size, each rank and loader worker its share. Its `state_dict()` is
where the last sample handed out leaves the rows (rows read, and tokens given of the next one), so a
resumed run passes over the rows read without tokenizing them and reads on from there: the same samples as
a run that went through.

Not here: packing (its rows are planned over all samples' lengths; a stream's samples are padded by the
collate), and counts at start (nothing is read before training: the lines at start say the tokenizer and
that the rows are streamed)."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Union

import torch
from torch.utils.data import IterableDataset

from launcher.data.text import samples as making, sources, tokenizer as tokenizers


class TextStream(IterableDataset):
    """TextDataset's items `{"input_ids", "labels", "attention_mask"}`, one sample each, read as they come.

    Its arguments are TextDataset's (see there), but packing, which must be false: `seed` and `batch_size` are
    taken so that a recipe of TextDataset's keys streams by changing `_target_` alone."""

    def __init__(self, tokenizer: str, files: Union[str, List[str]], format: str = "chat", max_len: int = 2048,
                 columns: Optional[Dict[str, str]] = None, template: Optional[str] = None,
                 chat_template: Optional[str] = None, loss_on: str = "answers", overlong: str = "truncate",
                 bad_rows: str = "error", packing: bool = False, seed: int = 0, split: str = "train",
                 text_rows: str = "document", batch_size: Optional[int] = None):
        if packing is True:
            raise ValueError("packing: a TextStream is not packed (packing plans rows over every sample's length); "
                             "packing: false pads its samples, or launcher.data.text.TextDataset packs them")
        making.check(format, max_len, loss_on, overlong, bad_rows, packing, text_rows, template, chat_template)
        # every name resolved once, at start: a mistake is one line before a step, and each epoch reads these
        self.files = [str(path) for path in sources.paths(files)]
        self.tokenizer = tokenizers.load(tokenizer)
        self.make = making.make(format, self.tokenizer, tokenizer, making.columns(format, columns), loss_on,
                                template, chat_template)
        self.format, self.max_len, self.overlong, self.bad_rows = format, max_len, overlong, bad_rows
        self.split, self.text_rows = split, text_rows
        self.counts = making.Counts()  # of the pass under way: rows made into samples, skipped, over max_len
        self.place: making.Place = (0, 0)  # where the last sample handed out leaves the rows
        self.resume_at: Optional[making.Place] = None
        named = files if isinstance(files, str) else ", ".join(map(str, files))
        self.notes = [making.tokenizer_line(self.tokenizer, tokenizer, format, self.make, chat_template),
                      f"{named}: streamed as {format}, rows read and tokenized as they come (none counted at start; "
                      f"max_len {max_len}, overlong: {overlong}, bad_rows: {bad_rows})"]

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        """The samples from the start, or from the place `load_state_dict` gave (that pass only)."""
        skip, drop = self.resume_at or (0, 0)
        self.resume_at, self.counts = None, making.Counts()
        for place, sample in self._samples(skip, drop):
            self.place = place  # before the item goes: state_dict() is asked for once it is taken
            yield making.item(sample)

    def _samples(self, skip: int, drop: int) -> Iterator[tuple]:
        rows = sources.rows(self.files, self.split, self.text_rows)
        read = making.made(rows, self.make, self.bad_rows, self.counts, skip)
        if self.format == "text":
            return making.cut(read, self.max_len, drop)
        return making.fit(read, self.max_len, self.overlong, self.counts)

    def state_dict(self) -> Dict[str, Any]:
        """Where the samples handed out leave the rows: how many rows were read before the next sample's first
        token, and how many tokens of that row were given (text rows cut across documents)."""
        rows, drop = self.place
        return {"rows": rows, "drop": drop}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.resume_at = (int(state["rows"]), int(state["drop"]))
