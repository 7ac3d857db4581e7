"""Rows into samples, `{"input_ids": [...], "labels": [...]}` (labels -100 where no loss is taken), for the
formats that need no chat template: `text` (continued pretraining) and `prompt_completion`; `chat` is in
chat.py. What they share is here: a row a format cannot take (`BadRow`), and labels from character spans.

Labels come from token offsets: a sample's text is rendered whole, tokenized once with its offsets, and a
token is trained on where its characters overlap an answer's span (as transformers' own
`return_assistant_tokens_mask` marks tokens). Pieces are never tokenized apart: the tokens at a boundary are
the ones the whole text gives, which tokenizing the prompt and the answer apart need not give."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from launcher.errors import first_line, short

IGNORE = -100  # what torch's cross-entropy and HF's models leave out of the loss
# The characters a token of max_len may stand for in a row that is rendered and truncated (chat,
# prompt_completion): a row of more is refused before it is rendered or tokenized, since all of it would be
# (tokens a few characters long: a row 64 times max_len's tokens keeps a 16th of itself at most).
ROW_CHARACTERS = 64
LOSS_ON = ("answers", "all")
Sample = Dict[str, List[int]]
Span = Tuple[int, int]  # characters [start, end) of a rendered text


class BadRow(Exception):
    """A row this format cannot take; the message says what is wrong and what would be valid, without the row's
    place (the dataset adds it)."""


def column(row: Dict[str, Any], name: str, kind: type, what: str) -> Any:
    """row[name], which must be a `kind`; BadRow otherwise."""
    if name not in row:
        raise BadRow(f"no column {name!r} ({what}); it has {', '.join(map(repr, row)) or 'none'}")
    if row[name] is None:
        raise BadRow(f"column {name!r} is null; it holds {what}")
    value = row[name]
    if not isinstance(value, kind):
        raise BadRow(f"column {name!r} holds {type(value).__name__} {short(value)}; {what} is a {kind.__name__}")
    return value


def sized(characters: int, max_len: Optional[int]) -> int:
    """A row's size in characters, where it is within what max_len tokens can use; BadRow otherwise."""
    if max_len is not None and characters > ROW_CHARACTERS * max_len:
        raise BadRow(f"{characters:,} characters, more than a row of max_len {max_len} tokens may hold "
                     f"({ROW_CHARACTERS} characters a token: {ROW_CHARACTERS * max_len:,}): it would be rendered and "
                     f"tokenized whole to keep its first {max_len} tokens; split it, or raise max_len")
    return characters


class TokenizerFailed(Exception):
    """The tokenizers library failed on a row: it panicked, or took longer than its backstop (`encode`)."""


# A backstop of wall-clock time for one tokenizing: the library's regexes (Oniguruma's) cannot be metered, and one
# that backtracks polynomially takes up to its retry limit at each character of a row (hours for a long row); a
# row of max_len 2048's characters takes a tenth of a second. Not a bound ranks agree on: a user's mistake past it.
SECONDS = 60.0
CHARACTERS_A_SECOND = 10_000  # and this much more time for a long text
_thread: Optional[Tuple[int, "queue.SimpleQueue", "queue.SimpleQueue"]] = None  # this process's: (pid, jobs, done)


def encode(tokenizer: Any, text: str, **kwargs) -> Any:
    """tokenizer(text, **kwargs), in a thread of its own (the library lets go of Python's lock as it works), waited
    for within the backstop; TokenizerFailed past it, or where the library panicked."""
    global _thread
    if _thread is None or _thread[0] != os.getpid():  # (a forked process has no thread of its parent's)
        _thread = (os.getpid(), queue.SimpleQueue(), queue.SimpleQueue())
        threading.Thread(target=_tokenizing, args=_thread[1:], name="tokenizing", daemon=True).start()
    _thread[1].put((tokenizer, text, kwargs))
    limit = SECONDS + len(text) / CHARACTERS_A_SECOND
    try:
        ok, value = _thread[2].get(timeout=limit)
    except queue.Empty:  # the call cannot be stopped: the process ends with the line about it (and a call after
        _thread = None  # this one, if any, gets a thread of its own)
        raise TokenizerFailed(f"took more than {limit:.0f} s on it (a backstop of wall-clock time)") from None
    if ok:
        return value
    if type(value).__name__ == "PanicException":  # pyo3's: a BaseException (Oniguruma's retry limit passed)
        raise TokenizerFailed(f"panicked on it: {first_line(value)[:120]}")
    raise value


def _tokenizing(jobs: "queue.SimpleQueue", done: "queue.SimpleQueue") -> None:
    while True:
        tokenizer, text, kwargs = jobs.get()
        try:
            done.put((True, tokenizer(text, **kwargs)))
        except BaseException as e:  # handed to the caller, which says what it is
            done.put((False, e))


def labelled(tokenizer: Any, text: str, spans: Sequence[Span], loss_on: str, special: bool = False) -> Sample:
    """`text` tokenized once, labelled where its tokens overlap `spans` (or everywhere, loss_on all).
    `special`: with the tokens the tokenizer adds itself (BOS), which have no characters."""
    # verbose=False: no warning for a text longer than the model's context; max_len is the dataset's to apply
    encoded = encode(tokenizer, text, add_special_tokens=special, return_offsets_mapping=True, verbose=False)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    if loss_on == "all":
        return {"input_ids": ids, "labels": list(ids)}
    labels, at = [IGNORE] * len(ids), 0
    for i, (start, end) in enumerate(offsets):  # spans and offsets are both in order: one pass
        while at < len(spans) and start >= spans[at][1]:
            at += 1
        if at == len(spans):
            break
        if end > spans[at][0]:  # overlaps the span; a token the tokenizer gave no characters (trim_offsets
            labels[i] = ids[i]   # leaves a lone space so) counts where it stands, as transformers counts it
    return {"input_ids": ids, "labels": labels}


def ended(sample: Sample, eos: int) -> Sample:
    """The sample with EOS after it, a target: the end of the answer (a tokenizer that adds EOS itself gave
    it no characters, so no span marked it)."""
    if sample["input_ids"][-1:] != [eos]:
        sample["input_ids"].append(eos)
        sample["labels"].append(eos)
    sample["labels"][-1] = eos
    return sample


class Text:
    """A document per row (its `text` column): all its tokens, with BOS where the tokenizer adds one and EOS
    after it. The dataset joins them and cuts the stream into rows of max_len."""

    roles = {"text": "the document"}

    def __init__(self, tokenizer: Any, columns: Dict[str, str], loss_on: str):
        self.tokenizer, self.name = tokenizer, columns["text"]

    def __call__(self, row: Dict[str, Any]) -> Optional[Sample]:
        text = column(row, self.name, str, "the document")
        if not text.strip():
            return None  # nothing to learn; not a mistake
        ids = list(encode(self.tokenizer, text, add_special_tokens=True, verbose=False)["input_ids"])
        return ended({"input_ids": ids, "labels": list(ids)}, self.tokenizer.eos_token_id)


class PromptCompletion:
    """A prompt and its completion (two columns), joined by `template` ("{prompt}" and "{completion}" in it,
    once each, the prompt first) or, without one, one after the other; EOS after it. The answer is the
    completion with what the template writes after it, and EOS."""

    roles = {"prompt": "the prompt", "completion": "the completion"}

    def __init__(self, tokenizer: Any, columns: Dict[str, str], loss_on: str, template: Optional[str] = None,
                 max_len: Optional[int] = None):
        template = "{prompt}{completion}" if template is None else template
        check_template(template)
        self.tokenizer, self.columns, self.loss_on, self.max_len = tokenizer, columns, loss_on, max_len
        self.before, rest = template.split("{prompt}")
        self.between, self.after = rest.split("{completion}")

    def __call__(self, row: Dict[str, Any]) -> Sample:
        prompt = column(row, self.columns["prompt"], str, "the prompt")
        completion = column(row, self.columns["completion"], str, "the completion")
        sized(len(prompt) + len(completion), self.max_len)
        head = self.before + prompt + self.between
        text = head + completion + self.after
        sample = labelled(self.tokenizer, text, [(len(head), len(text))], self.loss_on, special=True)
        return ended(sample, self.tokenizer.eos_token_id)


def check_template(template: Any) -> None:
    """A prompt/completion template, or ValueError saying what one is."""
    if not isinstance(template, str) or template.count("{prompt}") != 1 or template.count("{completion}") != 1 \
            or template.index("{prompt}") > template.index("{completion}"):
        raise ValueError(f"template: {short(template)}: a prompt_completion template holds {{prompt}} and then "
                         f"{{completion}}, once each, e.g. '### Question: {{prompt}}\\n### Answer: {{completion}}'")
