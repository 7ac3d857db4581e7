"""`TextDataset`: text files and a model folder's tokenizer made into a map-style dataset of token samples, for
`data.train` / `data.val` in any recipe. It joins the pieces, each in its own file: the rows (sources.py), the
tokenizer (tokenizer.py), the format that turns a row into a sample (formats.py, chat.py) one row after
another (samples.py, which TextStream shares to stream the same samples), and, where asked, the packer
(packing.py).

Every rank builds it alike from the same files (no randomness but packing's, from `seed`), so each holds the
same samples in the same order (and rows); the sampler then gives each rank its share. The samples are kept in memory,
tokenized at start (no cache yet: issue 35's item 6). Its `notes` are the lines the run says at start: what
was read and made of it, what was truncated, dropped or skipped."""

from __future__ import annotations

from typing import Dict, List, Optional, Union

import torch
from torch.utils.data import Dataset

from launcher.data.text import packing as packer, samples as making, sources, tokenizer as tokenizers
from launcher.data.text.formats import IGNORE, Sample
from launcher.errors import UserError


class TextDataset(Dataset):
    """Items `{"input_ids", "labels", "attention_mask"}` (LongTensors of one sample each) for a causal LM;
    `launcher.data.collate.Pad` with `values: {labels: -100}` pads them into batches.

    tokenizer: the model folder holding tokenizer.json (recipes name it once: ${model.config.pretrained_model_name_or_path})
    files: a path, a glob or a list of them (.jsonl .json .csv .parquet .txt, or a save_to_disk folder)
    format: chat (a column of {role, content} messages), prompt_completion, or text (continued pretraining)
    max_len: tokens per sample at most; text is cut into rows of max_len
    columns: the column each part is in, where not the default: {messages: ...}, {prompt: ..., completion: ...}, {text: ...}
    template: prompt_completion's, "{prompt}" then "{completion}" in it (default: the two one after the other)
    chat_template: a Jinja chat template (or a .jinja file) instead of the tokenizer's own
    loss_on: answers (the assistant turns, the completion) or all (every token)
    overlong: truncate (cut at max_len) or drop, for a sample longer than max_len (chat, prompt_completion)
    bad_rows: error (one line naming the file and row) or skip (counted, and the first one said)
    packing: several samples in one row of max_len, none seeing another (collate: launcher.data.collate.Packed)
    seed: packing's, given the recipe's seed (${seed})
    batch_size: with packing, the batch a line at start reckons padding in (the recipe's ${data.batch_size})
    split: the split of a saved DatasetDict
    text_rows: a .txt file as one row (document) or a row per line (line)
    """

    def __init__(self, tokenizer: str, files: Union[str, List[str]], format: str = "chat", max_len: int = 2048,
                 columns: Optional[Dict[str, str]] = None, template: Optional[str] = None,
                 chat_template: Optional[str] = None, loss_on: str = "answers", overlong: str = "truncate",
                 bad_rows: str = "error", packing: bool = False, seed: int = 0, split: str = "train",
                 text_rows: str = "document", batch_size: Optional[int] = None):
        making.check(format, max_len, loss_on, overlong, bad_rows, packing, text_rows, template, chat_template)
        self.tokenizer = tokenizers.load(tokenizer)
        self.pad_id = tokenizers.pad_id(self.tokenizer)  # what a packer fills a row's end with
        make = making.make(format, self.tokenizer, tokenizer, making.columns(format, columns), loss_on, template,
                           chat_template)
        counts = making.Counts()
        read = making.made(sources.rows(files, split, text_rows), make, bad_rows, counts)
        if format == "text":
            self.samples = [sample for _, sample in making.cut(read, max_len)]
        else:
            self.samples = [sample for _, sample in making.fit(read, max_len, overlong, counts)]
        if not self.samples:
            raise UserError(f"files: {_named(files)}: no samples in them ({counts.rows} rows taken as {format}, "
                            f"{counts.skipped} skipped)")
        # the lines the run says at start, under this dataset's key (data.train: ...), on rank 0
        self.notes = [making.tokenizer_line(self.tokenizer, tokenizer, format, make, chat_template),
                      _summary(files, format, counts.rows, self.samples, loss_on)]
        if counts.over:
            lost = counts.lost
            then = f"truncated at it{f' ({lost} of them, left with no answer token, dropped)' if lost else ''}"
            self.notes.append(f"{counts.over} of {counts.rows} samples longer than max_len {max_len} tokens: "
                              f"{then if overlong == 'truncate' else 'dropped'} (overlong: {overlong})")
        if counts.skipped:
            self.notes.append(f"{_count(counts.skipped, 'malformed row')} skipped (bad_rows: skip); the first: "
                              f"{counts.first}")
        # which samples make each item: one each, or packed several to a row (packing.py, from the seed alone)
        lengths = [len(sample["input_ids"]) for sample in self.samples]
        self.rows, self.packed = [[i] for i in range(len(self.samples))], packing
        if packing:
            self.rows = packer.plan(lengths, max_len, seed)
        if packing and batch_size:
            self.notes.append(packer.padding(lengths, self.rows, max_len, batch_size, seed))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        """A sample with its attention_mask (ones: the collate's padding adds the zeros), or a packed row:
        input_ids, labels, position_ids and document_ids (packing.join), joined as it is asked for."""
        if self.packed:
            return making.item(packer.join([self.samples[i] for i in self.rows[index]]), mask=False)
        return making.item(self.samples[self.rows[index][0]])


def _summary(files, format: str, rows: int, samples: List[Sample], loss_on: str) -> str:
    """'chat.jsonl: 400 rows as chat -> 400 samples of 27 to 211 tokens, 29043 tokens, 40% of them targets'."""
    lengths = [len(s["input_ids"]) for s in samples]
    tokens = sum(lengths)
    if format == "text":  # every token is a target (but each row's first, which nothing predicts)
        return (f"{_named(files)}: {_count(rows, 'document')} as text -> joined with EOS into "
                f"{_count(len(samples), 'row')} of {max(lengths)} tokens, {tokens} tokens, every one a target")
    targets = sum(label != IGNORE for s in samples for label in s["labels"][1:])  # the first is never predicted
    return (f"{_named(files)}: {_count(rows, 'row')} as {format} -> {_count(len(samples), 'sample')} of "
            f"{min(lengths)} to {max(lengths)} tokens, {tokens} tokens, {100 * targets / max(tokens, 1):.0f}% of them "
            f"targets (loss_on: {loss_on})")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _named(files) -> str:
    return files if isinstance(files, str) else ", ".join(map(str, files))
