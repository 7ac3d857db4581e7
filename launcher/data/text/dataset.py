"""`TextDataset`: text files and a model folder's tokenizer made into a map-style dataset of token samples, for
`data.train` / `data.val` in any recipe. It joins the pieces, each in its own file: the rows (sources.py), the
tokenizer (tokenizer.py), the format that turns a row into a sample (formats.py, chat.py) one row after
another (samples.py, which TextStream shares to stream the same samples), and, where asked, the packer
(packing.py).

Every rank builds it alike from the same files (no randomness but packing's, from `seed`), so each holds the
same samples in the same order (and rows); the sampler then gives each rank its share. The samples are kept in memory,
tokenized at start, or read from the cache (cache.py) where the same files, tokenizer and settings made them
before: one rank tokenizes while the others wait, then all read its entry. Its `notes` are the lines the run
says at start: what was read and made of it, what was truncated, dropped or skipped, and whether the cache
held it."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.utils.data import Dataset

from launcher.data.text import cache as token_cache, packing as packer, preference, samples as making, sources, \
    tokenizer as tokenizers
from launcher.data.text.formats import IGNORE, Sample
from launcher.errors import UserError

LARGE = 64 << 20  # bytes of files from which tokenizing shows a progress bar and num_proc: auto takes processes
MAX_PROCESSES = 8


class TextDataset(Dataset):
    """Items `{"input_ids", "labels", "attention_mask"}` (LongTensors of one sample each) for a causal LM;
    `launcher.data.collate.Pad` with `values: {labels: -100}` pads them into batches. Format preference's items
    are pairs (preference.py: chosen_input_ids, chosen_labels, rejected_...; packed, rows of whole pairs),
    collated by `launcher.data.collate.Pairs`, with `pairs`, `pair_item`, `attach_reference`, `reference_key`.

    tokenizer: the model folder holding tokenizer.json (recipes name it once: ${model.config.pretrained_model_name_or_path})
    files: a path, a glob or a list of them (.jsonl .json .csv .parquet .txt, or a save_to_disk folder)
    format: chat (a column of {role, content} messages), prompt_completion, text (continued pretraining), or
        preference (prompt, chosen, rejected: strings or conversations, as TRL reads them; pairs.py)
    max_len: tokens per sample at most; text is cut into rows of max_len
    columns: the column each part is in, where not the default: {messages: ...}, {prompt: ..., completion: ...},
        {text: ...}, {prompt: ..., chosen: ..., rejected: ...}
    template: prompt_completion's, "{prompt}" then "{completion}" in it (default: the two one after the other)
    chat_template: a Jinja chat template (or a .jinja file) instead of the tokenizer's own
    loss_on: answers (the assistant turns, the completion) or all (every token)
    overlong: truncate (cut at max_len) or drop, for a sample longer than max_len (chat, prompt_completion; a
        pair with a sequence longer than max_len, preference)
    bad_rows: error (one line naming the file and row) or skip (counted, and the first one said)
    packing: several samples in one row of max_len, none seeing another (collate: launcher.data.collate.Packed);
        preference: whole pairs in rows of 2 x max_len (collate: launcher.data.collate.Pairs)
    seed: packing's, given the recipe's seed (${seed})
    batch_size: with packing, the batch a line at start reckons padding in (the recipe's ${data.batch_size})
    split: the split of a saved DatasetDict
    text_rows: a .txt file as one row (document) or a row per line (line)
    cache: where the tokenized samples are kept for the next run: true (the default folder: $LAUNCHER_CACHE/text,
        else $XDG_CACHE_HOME/launcher/text, else ~/.cache/launcher/text), a folder, or null (tokenized each run)
    num_proc: processes that tokenize (as HF datasets' map): auto (one for files under LARGE bytes, else one a
        CPU this process may use, at most 8) or a number; the samples are the same whatever it is
    """

    def __init__(self, tokenizer: str, files: Union[str, List[str]], format: str = "chat", max_len: int = 2048,
                 columns: Optional[Dict[str, str]] = None, template: Optional[str] = None,
                 chat_template: Optional[str] = None, loss_on: str = "answers", overlong: str = "truncate",
                 bad_rows: str = "error", packing: bool = False, seed: int = 0, split: str = "train",
                 text_rows: str = "document", batch_size: Optional[int] = None,
                 cache: Union[str, bool, None] = True, num_proc: Union[int, str] = "auto"):
        making.check(format, max_len, loss_on, overlong, bad_rows, packing, text_rows, template, chat_template)
        _check_cache(cache)
        _check_num_proc(num_proc)
        self.tokenizer = tokenizers.load(tokenizer)
        self.pad_id = tokenizers.pad_id(self.tokenizer)  # what a packer fills a row's end with
        columns = making.columns(format, columns)
        make, used = making.maker(format, self.tokenizer, tokenizer, columns, loss_on, template, chat_template, max_len)
        # everything that changes a sample (packing does not: its rows are drawn below, from the lengths)
        settings = {"format": format, "columns": columns, "template": template, "chat_template": used,
                    "max_len": max_len, "loss_on": loss_on, "overlong": overlong, "bad_rows": bad_rows,
                    "split": split, "text_rows": text_rows}
        if format == "preference":  # a conversation's answer scored to its text's end (pairs.py) since this mark
            settings["answers"] = "to the end"
        self.format, self.pairwise = format, format == "preference"  # pairwise: samples two by two, a pair each
        self.samples, counts, cached, self.key = _cached_or_tokenized(files, tokenizer, make, settings, cache,
                                                                      num_proc)
        # the lines the run says at start, under this dataset's key (data.train: ...), on rank 0: the same
        # whether the samples were tokenized now or read from the cache, but the last, which says which
        self.notes = [making.tokenizer_line(self.tokenizer, tokenizer, format, make, chat_template),
                      preference.summary(_named(files), counts["rows"], self.samples) if self.pairwise else
                      _summary(files, format, counts["rows"], self.samples, loss_on),
                      *making.unread(counts["unread"])]
        if self.pairwise:
            self.notes += preference.overlong(counts, max_len, overlong)
        elif counts["over"]:
            over, lost = counts["over"], counts["lost"]
            then = f"truncated at it{f' ({lost} of them, left with no answer token, dropped)' if lost else ''}"
            self.notes.append(f"{over} of {counts['rows']} samples longer than max_len {max_len} tokens: "
                              f"{then if overlong == 'truncate' else 'dropped'} (overlong: {overlong})")
        if counts["skipped"]:
            self.notes.append(f"{_count(counts['skipped'], 'malformed row')} skipped (bad_rows: skip); the first: "
                              f"{counts['first']}")
        self.largest = counts["largest"]  # token id, for the model's embedding rows (check_vocabulary)
        # which samples (pairs) make each item: one each, or packed several to a row (packing.py, from the seed
        # alone); a row of pairs holds two sequences of max_len, so that every pair fits whole
        lengths = preference.lengths(self.samples) if self.pairwise else [len(s["input_ids"]) for s in self.samples]
        room = 2 * max_len if self.pairwise else max_len
        self.rows, self.packed = [[i] for i in range(len(lengths))], packing
        if packing:
            self.rows = packer.plan(lengths, room, seed)
        if packing and batch_size:
            self.notes.append(preference.padding(self.samples, self.rows, room, batch_size, seed) if self.pairwise
                              else packer.padding(lengths, self.rows, max_len, batch_size, seed))
        self.notes.append(cached)
        self.reference: Optional[preference.Reference] = None  # attach_reference's values

    def __len__(self) -> int:
        return len(self.rows)

    def check_vocabulary(self, rows: int) -> Optional[str]:
        """What is wrong where the model's input embedding has `rows` rows and a sample a token beyond them."""
        return making.beyond(self.tokenizer, self.largest, rows) if self.largest >= rows else None

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        """A sample with its attention_mask (ones: the collate's padding adds the zeros), or a packed row:
        input_ids, labels, position_ids and document_ids (packing.join), joined as it is asked for; format
        preference's, a pair or a row of whole pairs (preference.item, preference.row)."""
        if self.pairwise:
            if self.packed:
                return preference.row(self.samples, self.rows[index], self.reference)
            return preference.item(self.samples, self.rows[index][0], self.reference)
        if self.packed:
            return making.item(packer.join([self.samples[i] for i in self.rows[index]]), mask=False)
        return making.item(self.samples[self.rows[index][0]])

    # format preference's (preference.py): what a reference pass reads and what it gives back
    def pairs(self) -> int:
        """How many pairs."""
        return len(self._pairwise("pairs")) // 2

    def pair_item(self, k: int) -> Dict[str, torch.Tensor]:
        """Pair k unpacked (chosen_input_ids, chosen_labels, rejected_...), packed or not."""
        return preference.item(self._pairwise("pair_item"), k, self.reference)

    def attach_reference(self, values) -> None:
        """The reference's log-probabilities, values[k] = (chosen Float64[Lc], rejected Float64[Lr]), which the
        items carry from now on (chosen_ref_logps, rejected_ref_logps; packed: ref_logps)."""
        self.reference = preference.checked(self._pairwise("attach_reference"), values)

    def reference_key(self) -> str:
        """A digest of everything the tokens were made from: the token cache's key (made alike without a cache)."""
        self._pairwise("reference_key")
        return hashlib.sha256(self.key.as_json().encode()).hexdigest()

    def _pairwise(self, what: str) -> list:
        if not self.pairwise:
            raise TypeError(f"{what}(): a dataset of format preference's; this one's format is {self.format}")
        return self.samples


def _check_cache(cache) -> None:
    """The cache's value (the other arguments are checked by samples.check, as TextStream's), or ValueError."""
    if not (cache is None or isinstance(cache, bool) or isinstance(cache, str) and cache):
        raise ValueError(f"cache: {cache!r}: true (the default folder), a folder, or null (no cache)")


def _cached_or_tokenized(files, folder: str, make, settings: Dict[str, Any], cache,
                         num_proc: Union[int, str]) -> Tuple[List[Sample], dict, str, Optional[token_cache.Key]]:
    """The samples and the counts the lines at start are made of, from the cache where it holds them for these
    files, this tokenizer and these settings (cache.py), else tokenized now; the line that says which; and the
    key (made without a cache too for preference, whose reference is kept by it)."""
    found = sources.paths(files)
    settings = {"files": files if isinstance(files, str) else list(map(str, files)), **settings}
    root = token_cache.folder(cache)
    under = None if root is None and settings["format"] != "preference" else \
        token_cache.key(found, Path(folder).expanduser(), tokenizers.files(folder), settings)
    size = _size(found)  # the files walked once
    progress, processes = _progress(size), _processes(size, num_proc, alone=root is not None)
    return (*token_cache.cached(root, under, lambda: _tokenized(files, make, settings, progress, processes)), under)


def _tokenized(files, make, settings: Dict[str, Any], progress: bool,
               processes: int = 1) -> Tuple[List[Sample], Dict[str, Any]]:
    """The files' samples, and the counts the lines at start are made of: what the cache keeps."""
    format, max_len = settings["format"], settings["max_len"]
    rows = sources.rows(files, settings["split"], settings["text_rows"])
    if progress:
        from tqdm import tqdm

        rows = tqdm(rows, desc="tokenizing", unit=" rows", mininterval=1.0)
    counts = making.Counts()
    read = making.made(rows, make, settings["bad_rows"], counts, processes=processes)
    if format == "text":
        samples = [sample for _, sample in making.cut(read, max_len)]
    elif format == "preference":
        samples = preference.flat(preference.fit(read, max_len, settings["overlong"], counts))
    else:
        samples = [sample for _, sample in making.fit(read, max_len, settings["overlong"], counts)]
    if not samples:
        raise UserError(making.empty(_named(files), format, max_len, settings["overlong"], counts))
    largest = max(max(sample["input_ids"]) for sample in samples)
    return samples, {**asdict(counts), "unread": sorted(counts.unread), "samples": len(samples), "largest": largest}


def _check_num_proc(num_proc) -> None:
    if num_proc != "auto" and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
        raise ValueError(f"num_proc: {num_proc!r}: auto, or the number of processes that tokenize (1 or more)")


def _processes(size: int, num_proc: Union[int, str], alone: bool) -> int:
    """The processes that tokenize: the recipe's number, or for auto one (small files: spawning processes
    that import torch and transformers costs seconds) or, from LARGE bytes of files, one a CPU this process
    may use, at most MAX_PROCESSES. Under torchrun the ranks wait for one to fill the cache, so its processes
    have the machine; without a cache every rank tokenizes, and the CPUs are shared among a machine's ranks."""
    if num_proc != "auto":
        return num_proc
    if size < LARGE:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not alone:
        cpus //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(MAX_PROCESSES, cpus))


def _size(paths: List[Path]) -> int:
    return sum(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
               for path in paths)


def _progress(size: int) -> bool:
    """Whether tokenizing shows a bar: for large files (`size` bytes), on a terminal, on global rank 0 alone
    (torchrun's RANK; a rank that waits for another to fill the cache shows nothing)."""
    return size >= LARGE and sys.stderr.isatty() and os.environ.get("RANK", "0") == "0"


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
