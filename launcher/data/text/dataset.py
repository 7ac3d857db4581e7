"""`TextDataset`: text files and a model folder's tokenizer made into a map-style dataset of token samples, for
`data.train` / `data.val` in any recipe. It joins the pieces, each in its own file: the rows (sources.py), the
tokenizer (tokenizer.py), the format that turns a row into a sample (formats.py, chat.py), and, where asked,
the packer (packing.py).

Every rank builds it alike from the same files (no randomness but packing's, from `seed`), so each holds the
same samples in the same order (and rows); the sampler then gives each rank its share. The samples are kept in memory,
tokenized at start, or read from the cache (cache.py) where the same files, tokenizer and settings made them
before: one rank tokenizes while the others wait, then all read its entry. Its `notes` are the lines the run
says at start: what was read and made of it, what was truncated, dropped or skipped, and whether the cache
held it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.utils.data import Dataset

from launcher.data.text import cache as token_cache, packing as packer, sources, tokenizer as tokenizers
from launcher.data.text.chat import BadTemplate, Chat
from launcher.data.text.formats import IGNORE, LOSS_ON, BadRow, PromptCompletion, Sample, Text
from launcher.errors import UserError

FORMATS = {"chat": Chat, "prompt_completion": PromptCompletion, "text": Text}
OVERLONG = ("truncate", "drop")
BAD_ROWS = ("error", "skip")
LARGE = 64 << 20  # bytes of files from which tokenizing shows a progress bar (tens of thousands of rows and up)


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
    cache: where the tokenized samples are kept for the next run: true (the default folder: $LAUNCHER_CACHE/text,
        else $XDG_CACHE_HOME/launcher/text, else ~/.cache/launcher/text), a folder, or null (tokenized each run)
    """

    def __init__(self, tokenizer: str, files: Union[str, List[str]], format: str = "chat", max_len: int = 2048,
                 columns: Optional[Dict[str, str]] = None, template: Optional[str] = None,
                 chat_template: Optional[str] = None, loss_on: str = "answers", overlong: str = "truncate",
                 bad_rows: str = "error", packing: bool = False, seed: int = 0, split: str = "train",
                 text_rows: str = "document", batch_size: Optional[int] = None,
                 cache: Union[str, bool, None] = True):
        _check(format, max_len, loss_on, overlong, bad_rows, packing, text_rows, template, chat_template, cache)
        self.tokenizer = tokenizers.load(tokenizer)
        self.pad_id = tokenizers.pad_id(self.tokenizer)  # what a packer fills a row's end with
        columns = _columns(format, columns)
        used = tokenizers.chat_template(self.tokenizer, chat_template, tokenizer) if format == "chat" else None
        make = _format(format, self.tokenizer, columns, loss_on, template, used)
        # everything that changes a sample (packing does not: its rows are drawn below, from the lengths)
        settings = {"format": format, "columns": columns, "template": template, "chat_template": used,
                    "max_len": max_len, "loss_on": loss_on, "overlong": overlong, "bad_rows": bad_rows,
                    "split": split, "text_rows": text_rows}
        self.samples, counts, cached = _cached_or_tokenized(files, tokenizer, make, settings, cache)
        # the lines the run says at start, under this dataset's key (data.train: ...), on rank 0: the same
        # whether the samples were tokenized now or read from the cache, but the last, which says which
        self.notes = [f"tokenizer of {tokenizer}: {len(self.tokenizer)} tokens, {tokenizers.described(self.tokenizer)}"
                      + (f"; {make.described(chat_template)}" if format == "chat" else ""),
                      _summary(files, format, counts["rows"], self.samples, loss_on)]
        if counts["over"]:
            over, lost = counts["over"], counts["lost"]
            then = f"truncated at it{f' ({lost} of them, left with no answer token, dropped)' if lost else ''}"
            self.notes.append(f"{over} of {counts['rows']} samples longer than max_len {max_len} tokens: "
                              f"{then if overlong == 'truncate' else 'dropped'} (overlong: {overlong})")
        if counts["skipped"]:
            self.notes.append(f"{_count(counts['skipped'], 'malformed row')} skipped (bad_rows: skip); the first: "
                              f"{counts['first']}")
        # which samples make each item: one each, or packed several to a row (packing.py, from the seed alone)
        lengths = [len(sample["input_ids"]) for sample in self.samples]
        self.rows, self.packed = [[i] for i in range(len(self.samples))], packing
        if packing:
            self.rows = packer.plan(lengths, max_len, seed)
        if packing and batch_size:
            self.notes.append(packer.padding(lengths, self.rows, max_len, batch_size, seed))
        self.notes.append(cached)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        """A sample with its attention_mask (ones: the collate's padding adds the zeros), or a packed row:
        input_ids, labels, position_ids and document_ids (packing.join), joined as it is asked for."""
        if self.packed:
            row = packer.join([self.samples[i] for i in self.rows[index]])
            return {key: torch.tensor(value, dtype=torch.long) for key, value in row.items()}
        item = {key: torch.tensor(value, dtype=torch.long) for key, value in self.samples[self.rows[index][0]].items()}
        item["attention_mask"] = torch.ones_like(item["input_ids"])
        return item


def _check(format, max_len, loss_on, overlong, bad_rows, packing, text_rows, template, chat_template, cache) -> None:
    """The arguments' values, or ValueError: the recipe's mistake, which the launcher says under its key."""
    for key, value, valid in (("format", format, tuple(FORMATS)), ("loss_on", loss_on, LOSS_ON),
                              ("overlong", overlong, OVERLONG), ("bad_rows", bad_rows, BAD_ROWS),
                              ("text_rows", text_rows, sources.TEXT_ROWS)):
        if value not in valid:
            raise ValueError(f"{key}: {value!r} is not one of {', '.join(valid)}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len: {max_len!r}: the most tokens a sample has, an integer of 2 or more")
    if template is not None and format != "prompt_completion":
        raise ValueError(f"template: format {format} takes none (a prompt_completion's template); chat's is "
                         f"chat_template")
    if chat_template is not None and format != "chat":
        raise ValueError(f"chat_template: format {format} takes none")
    if packing is not False and packing is not True:
        raise ValueError(f"packing: {packing!r}: true or false")
    if not (cache is None or isinstance(cache, bool) or isinstance(cache, str) and cache):
        raise ValueError(f"cache: {cache!r}: true (the default folder), a folder, or null (no cache)")


def _columns(format: str, given: Optional[Dict[str, str]]) -> Dict[str, str]:
    roles = FORMATS[format].roles
    given = dict(given or {})
    for role, name in given.items():
        if role not in roles:
            raise ValueError(f"columns: {role!r}: format {format} reads the columns {', '.join(roles)}")
        if not isinstance(name, str):
            raise ValueError(f"columns.{role}: {name!r}: a column's name")
    return {role: given.get(role, role) for role in roles}


def _format(format: str, tokenizer: Any, columns: Dict[str, str], loss_on: str, template: Optional[str],
            chat_template: Optional[str]):
    if format == "chat":
        return Chat(tokenizer, columns, loss_on, chat_template)
    if format == "prompt_completion":
        return PromptCompletion(tokenizer, columns, loss_on, template)
    return Text(tokenizer, columns, loss_on)


def _cached_or_tokenized(files, folder: str, make, settings: Dict[str, Any], cache) -> Tuple[List[Sample], dict, str]:
    """The samples and the counts the lines at start are made of, from the cache where it holds them for these
    files, this tokenizer and these settings (cache.py), else tokenized now; and the line that says which."""
    found = sources.paths(files)
    settings = {"files": files if isinstance(files, str) else list(map(str, files)), **settings}
    root = token_cache.folder(cache)
    under = None if root is None else token_cache.key(found, Path(folder).expanduser(), tokenizers.files(folder),
                                                      settings)
    progress = _progress(found)
    return token_cache.cached(root, under, lambda: _tokenized(files, make, settings, progress))


def _tokenized(files, make, settings: Dict[str, Any], progress: bool) -> Tuple[List[Sample], Dict[str, Any]]:
    """The files' samples, and the counts the lines at start are made of: what the cache keeps."""
    format, max_len = settings["format"], settings["max_len"]
    rows = sources.rows(files, settings["split"], settings["text_rows"])
    if progress:
        from tqdm import tqdm

        rows = tqdm(rows, desc="tokenizing", unit=" rows", mininterval=1.0)
    read, (skipped, first) = _samples(rows, make, settings["bad_rows"])
    over = lost = 0
    if format == "text":
        samples = cut(read, max_len)
    else:
        samples, over, lost = fit(read, max_len, settings["overlong"])
    if not samples:
        raise UserError(f"files: {_named(files)}: no samples in them ({len(read)} rows taken as {format}, "
                        f"{skipped} skipped)")
    return samples, {"rows": len(read), "skipped": skipped, "first": first, "over": over, "lost": lost,
                     "samples": len(samples)}


def _progress(paths: List[Path]) -> bool:
    """Whether tokenizing shows a bar: for large files, on a terminal, on global rank 0 alone (torchrun's
    RANK; a rank that waits for another to fill the cache shows nothing)."""
    size = sum(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
               for path in paths)
    return size >= LARGE and sys.stderr.isatty() and os.environ.get("RANK", "0") == "0"


def _samples(rows: Iterable[sources.Row], make, bad_rows: str) -> Tuple[List[Sample], Tuple[int, str]]:
    """The samples of the rows that make one, and (how many were skipped, the first of them)."""
    samples, skipped, first = [], 0, ""
    for row in rows:
        try:
            if row.problem is not None:
                raise BadRow(row.problem)
            sample = make(row.value)
        except BadRow as e:
            if bad_rows == "error":
                raise UserError(f"{row.where}: {e} (bad_rows: skip would skip such rows and count them)") from None
            skipped, first = skipped + 1, first or f"{row.where}: {e}"
            continue
        except BadTemplate as e:
            raise UserError(f"{row.where}: {e}") from None
        if sample is not None:
            samples.append(sample)
    return samples, (skipped, first)


def cut(documents: List[Sample], max_len: int) -> List[Sample]:
    """Documents (each ending in EOS) joined into one stream of tokens, cut into rows of max_len; the last
    row keeps what is left (shorter, if it has a target)."""
    stream = [token for document in documents for token in document["input_ids"]]
    rows = [stream[at:at + max_len] for at in range(0, len(stream), max_len)]
    return [{"input_ids": row, "labels": list(row)} for row in rows if len(row) >= 2]


def fit(samples: List[Sample], max_len: int, overlong: str) -> Tuple[List[Sample], int, int]:
    """The samples that fit max_len (truncated ones too, with overlong: truncate), how many did not, and how
    many of those lost every target to truncation (and were dropped: they would teach nothing)."""
    kept, over, lost = [], 0, 0
    for sample in samples:
        if len(sample["input_ids"]) > max_len:
            over += 1
            if overlong == "drop":
                continue
            sample = {key: value[:max_len] for key, value in sample.items()}
            if all(label == IGNORE for label in sample["labels"][1:]):  # the first token is never predicted
                lost += 1
                continue
        kept.append(sample)
    return kept, over, lost


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
