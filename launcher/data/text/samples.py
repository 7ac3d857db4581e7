"""Rows into samples, one at a time: what `TextDataset` (all in memory) and `TextStream` (as they come) share.

The arguments are checked alike (`check`, `columns`), the format made alike (`make`), and each step is a
generator over the one before, so the same rows give the same samples in the same order to both:

    sources.rows -> made (a sample per row; bad rows raise or are counted) -> fit (chat, prompt_completion:
    max_len applied) or cut (text: documents joined and cut into rows of max_len)

Each sample comes with its place: the rows to skip and the tokens of the next row to drop to read on
right after it (a stream's `state_dict`). A `Counts` gathers what a run says about the rows as they pass."""

from __future__ import annotations

from collections import deque
from itertools import islice
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch

from launcher.data.text import sources, tokenizer as tokenizers
from launcher.data.text.chat import BadTemplate, Chat
from launcher.data.text.formats import IGNORE, LOSS_ON, BadRow, PromptCompletion, Sample, Text, TokenizerFailed
from launcher.data.text.pairs import Preference
from launcher.errors import UserError

FORMATS = {"chat": Chat, "prompt_completion": PromptCompletion, "text": Text, "preference": Preference}
OVERLONG = ("truncate", "drop")
BAD_ROWS = ("error", "skip")
Place = Tuple[int, int]  # (rows read before the next sample's first token, that row's tokens to drop)


@dataclass
class Counts:
    """What passed: rows made into samples, rows skipped (and the first), samples over max_len, and those of
    them truncated to no target (dropped); rows with nothing to learn (an empty text, every answer of weight
    0); what rows held that the chat template never reads."""

    rows: int = 0
    skipped: int = 0
    first: str = ""
    over: int = 0
    lost: int = 0
    empty: int = 0
    unread: Set[str] = field(default_factory=set)


def check(format, max_len, loss_on, overlong, bad_rows, packing, text_rows, template, chat_template) -> None:
    """The arguments' values, or ValueError: the recipe's mistake, which the launcher says under its key."""
    for key, value, valid in (("format", format, tuple(FORMATS)), ("loss_on", loss_on, LOSS_ON),
                              ("overlong", overlong, OVERLONG), ("bad_rows", bad_rows, BAD_ROWS),
                              ("text_rows", text_rows, sources.TEXT_ROWS)):
        if value not in valid:
            raise ValueError(f"{key}: {value!r} is not one of {', '.join(valid)}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len: {max_len!r}: the most tokens a sample has, an integer of 2 or more")
    if template is not None and format not in ("prompt_completion", "preference"):
        raise ValueError(f"template: format {format} takes none (a prompt_completion's template); chat's is "
                         f"chat_template")
    if chat_template is not None and format not in ("chat", "preference"):
        raise ValueError(f"chat_template: format {format} takes none")
    if format == "preference" and loss_on != "answers":
        raise ValueError(f"loss_on: {loss_on}: format preference scores the answers alone (loss_on: answers)")
    if packing is not False and packing is not True:
        raise ValueError(f"packing: {packing!r}: true or false")


def columns(format: str, given: Optional[Dict[str, str]]) -> Dict[str, str]:
    roles = FORMATS[format].roles
    given = dict(given or {})
    for role, name in given.items():
        if role not in roles:
            raise ValueError(f"columns: {role!r}: format {format} reads the columns {', '.join(roles)}")
        if not isinstance(name, str):
            raise ValueError(f"columns.{role}: {name!r}: a column's name")
    return {role: given.get(role, role) for role in roles}


def template_used(tokenizer: Any, format: str, chat_template: Optional[str], folder: str) -> Optional[str]:
    """The chat template a chat is rendered by (the recipe's, else the tokenizer's; one line where there is
    none); preference's, where there is one (its pairs of strings need none); None for the other formats."""
    if format == "preference" and chat_template is None and not tokenizer.chat_template:
        return None
    return tokenizers.chat_template(tokenizer, chat_template, folder) if format in ("chat", "preference") else None


def maker(format: str, tokenizer: Any, folder: str, columns: Dict[str, str], loss_on: str, template: Optional[str],
          chat_template: Optional[str], max_len: int):
    """The format's maker, with the chat template used (`template_used`); and that template."""
    used = template_used(tokenizer, format, chat_template, folder)
    origin = tokenizers.template_origin(chat_template, folder)
    return make(format, tokenizer, columns, loss_on, template, used, max_len, origin), used


def make(format: str, tokenizer: Any, columns: Dict[str, str], loss_on: str, template: Optional[str],
         chat_template: Optional[str], max_len: int, origin: str = "the chat template"):
    """The format's maker (chat_template: the one used, `template_used`; origin: where it is from,
    tokenizer.template_origin): a row's columns in, a sample (or None: nothing to learn) out."""
    if format == "chat":
        return Chat(tokenizer, columns, loss_on, chat_template, origin=origin, max_len=max_len)
    if format == "prompt_completion":
        return PromptCompletion(tokenizer, columns, loss_on, template, max_len)
    if format == "preference":
        return Preference(tokenizer, columns, loss_on, template, chat_template, max_len, origin)
    return Text(tokenizer, columns, loss_on)


def empty(files: str, format: str, max_len: int, overlong: str, counts: Counts) -> str:
    """The line that says why files gave no sample, with the counts."""
    taken = f"{counts.rows} rows taken as {format}"
    if counts.rows and counts.over == counts.rows and overlong == "drop":
        why = f"all {taken} are longer than max_len {max_len} tokens, and overlong: drop drops them"
    elif counts.rows and counts.lost == counts.rows:
        why = (f"all {taken} are longer than max_len {max_len} tokens, and truncated at it none keeps an answer "
               f"token (their answers start after token {max_len})")
    elif counts.rows:
        why = f"the {taken} hold fewer than 2 tokens in all"
    else:
        why = "no row made a sample"
    said = [why]
    if counts.skipped:
        said.append(f"{counts.skipped} skipped as malformed (bad_rows: skip), the first: {counts.first}")
    if counts.empty:
        said.append(f"{counts.empty} with nothing to learn (an empty text, or every answer of weight 0)")
    fix = "raise max_len, or give rows whose answers come sooner" if counts.over else "fix the rows"
    return f"files: {files}: no samples in them: {'; '.join(said)}; {fix}"


def beyond(tokenizer: Any, token: int, rows: int) -> str:
    """What is wrong where a sample holds `token`, and the model's input embedding has `rows` rows."""
    return (f"token {token} ({tokenizer.convert_ids_to_tokens(token)!r}) of the tokenizer ({len(tokenizer)} tokens) is "
            f"in the samples, and the model's input embedding has {rows} rows (ids 0 to {rows - 1}): a tokenizer "
            f"grown by added tokens needs the model's embedding resized to it (model.resize_token_embeddings("
            f"{len(tokenizer)}), then saved), or the model folder whose tokenizer it is")


def unread(said: Iterable[str]) -> List[str]:
    """The line on what rows held that the chat template never reads (Counts.unread), where they held any."""
    said = sorted(said)
    if not said:
        return []
    return [f"rows hold what the chat template never reads, so that no sample shows it: {', '.join(said)}"]


def tokenizer_line(tokenizer: Any, folder: str, format: str, maker, chat_template: Optional[str]) -> str:
    """'tokenizer of FOLDER: 249 tokens, BOS ..., EOS ...' and, for chat, how its answers are found."""
    return (f"tokenizer of {folder}: {len(tokenizer)} tokens, {tokenizers.described(tokenizer)}"
            + (f"; {maker.described(chat_template)}" if format in ("chat", "preference") else ""))


def made(rows: Iterable[sources.Row], maker, bad_rows: str, counts: Counts, skip: int = 0,
         processes: int = 1, vocabulary: Optional[int] = None) -> Iterator[tuple]:
    """(rows read through this one, its sample) for each row that makes one; a bad row raises one line, or
    (bad_rows: skip) is counted. The first `skip` rows are passed over unmade (a resumed stream).
    `processes` > 1 makes the samples in that many processes (`in_processes`): the same samples, counts and
    lines, in the same order. `vocabulary`: the model's embedding rows, which no token may reach (one line)."""
    read_rows = ((read, row) for read, row in enumerate(rows, 1) if read > skip)
    outcomes = in_processes(read_rows, maker, processes) if processes > 1 else (
        (read, row, _outcome(maker, row.value, row.problem)) for read, row in read_rows)
    unread = getattr(maker, "unread", None)
    for read, row, outcome in outcomes:
        if unread is not None and row.value is not None:
            counts.unread |= unread(row.value)
        if isinstance(outcome, BadRow):
            if bad_rows == "error":
                raise UserError(f"{row.where}: {outcome} (bad_rows: skip would skip such rows and count them)")
            counts.skipped, counts.first = counts.skipped + 1, counts.first or f"{row.where}: {outcome}"
        elif isinstance(outcome, BadTemplate):
            raise UserError(f"{row.where}: {outcome}")
        elif isinstance(outcome, TokenizerFailed):
            file = Path(getattr(maker.tokenizer, "name_or_path", "")) / "tokenizer.json"
            raise UserError(f"{row.where}: tokenizer: {file}: the tokenizers library {outcome}: a regex of its "
                            f"normalizer or pre-tokenizer backtracks on this row; give the tokenizer regexes that "
                            f"repeat characters and classes, as models' tokenizers do")
        elif outcome is None:
            counts.empty += 1
        else:
            counts.rows += 1
            if vocabulary is not None:  # (a tuple: preference's pair of samples)
                largest = max(max(s["input_ids"]) for s in (outcome if isinstance(outcome, tuple) else [outcome]))
                if largest >= vocabulary:
                    raise UserError(f"{row.where}: {beyond(maker.tokenizer, largest, vocabulary)}")
            yield read, outcome


def _outcome(maker, value: Any, problem: Optional[str]) -> Any:
    """A row's sample, None (nothing to learn), or what is wrong with it (BadRow, BadTemplate, TokenizerFailed),
    returned."""
    try:
        if problem is not None:
            raise BadRow(problem)
        return maker(value)
    except (BadRow, BadTemplate, TokenizerFailed) as e:
        return e


CHUNK = 256  # rows a process makes at a time
_MAKER = None  # a process's maker (in_processes)


def in_processes(read_rows: Iterator[tuple], maker, processes: int) -> Iterator[tuple]:
    """(read, row, outcome) as the serial path gives them, the rows made in `processes` processes: a window
    of CHUNK rows per process at a time is read, made and handed on in order, so that no more rows than a
    window are held beyond the samples. The processes are spawned (a fork beside torch.distributed's threads
    can hang) and each is given the maker once; a bug in one raises here with its traceback."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(processes, _hold, (maker,)) as pool:
        while True:
            window = list(islice(read_rows, CHUNK * processes * 4))
            if not window:
                return
            parts = [window[i:i + CHUNK] for i in range(0, len(window), CHUNK)]
            made_parts = pool.map(_make_part, [[(row.value, row.problem) for _, row in part] for part in parts])
            for part, outcomes in zip(parts, made_parts):
                for (read, row), outcome in zip(part, outcomes):
                    yield read, row, outcome


def _hold(maker) -> None:
    global _MAKER
    _MAKER = maker


def _make_part(part: List[tuple]) -> List[Any]:
    return [_outcome(_MAKER, value, problem) for value, problem in part]


def item(sample: Sample, mask: bool = True) -> Dict[str, torch.Tensor]:
    """A sample (or a packed row) as the loader takes it: LongTensors; `mask`: with its attention_mask (ones:
    the collate's padding adds the zeros; a packed row says where its samples are by its document_ids)."""
    out = {key: torch.tensor(value, dtype=torch.long) for key, value in sample.items()}
    if mask:
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    return out


def fit(samples: Iterable[tuple], max_len: int, overlong: str, counts: Counts) -> Iterator[Tuple[Place, Sample]]:
    """The samples that fit max_len (truncated ones too, with overlong: truncate), each with its place; those
    that did not are counted, and those that lost every target to truncation dropped (they would teach
    nothing)."""
    for read, sample in samples:
        if len(sample["input_ids"]) > max_len:
            counts.over += 1
            if overlong == "drop":
                continue
            sample = {key: value[:max_len] for key, value in sample.items()}
            if all(label == IGNORE for label in sample["labels"][1:]):  # the first token is never predicted
                counts.lost += 1
                continue
        yield (read, 0), sample


def cut(documents: Iterable[tuple], max_len: int, drop: int = 0) -> Iterator[Tuple[Place, Sample]]:
    """Documents (each ending in EOS) joined into one stream of tokens, cut into rows of max_len; the last
    row keeps what is left (shorter, if it has a target). `drop`: the first document's tokens given already.

    Each row comes with its place: the document its next token is in (rows read before it) and how many of
    that document's tokens are given, so that a stream reads on from there holding no more than a row's
    worth of tokens and the document they are in."""
    waiting: List[int] = []
    held: Deque[list] = deque()  # [rows read through the document, its tokens, its tokens still waiting]
    read = 0
    for read, document in documents:
        ids = document["input_ids"][drop:]
        held.append([read, len(document["input_ids"]), len(ids)])
        waiting += ids
        drop = 0
        while len(waiting) >= max_len:
            row, waiting = waiting[:max_len], waiting[max_len:]
            yield _given(held, max_len, read), {"input_ids": row, "labels": list(row)}
    if len(waiting) >= 2:
        yield (read, 0), {"input_ids": waiting, "labels": list(waiting)}


def _given(held: Deque[list], tokens: int, read: int) -> Place:
    """Takes `tokens` from the documents held, the first first; the place of the next token."""
    while tokens:
        taken = min(tokens, held[0][2])
        held[0][2] -= taken
        tokens -= taken
        if not held[0][2]:
            held.popleft()
    if not held:
        return read, 0
    through, length, left = held[0]
    return through - 1, length - left
