"""A JSON object from a file that is untrusted input (a model folder's config.json or index, a tokenizer's
files): read at most a bounded number of bytes, parsed by Python's parser, checked for nesting, or one line
naming the file (UserError). A leaf: the checkpoint package and the data path both read folders with it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, Optional

from launcher.errors import UserError, a_kind, first_line

MAX_JSON = 64 << 20  # an index of a 400B-parameter model's shards is a few MB, a config a few KB


def json_file(path: Path, what: str, max_depth: Optional[int] = None) -> Dict[str, Any]:
    """A JSON object in a file a user names (a safetensors index, a config), or one line. Python's parser
    recurses once per level of nesting: a file nested deeper than it goes is the file's problem, said as
    such, not a RecursionError. With `max_depth`, a file nested deeper than that is refused too: for a file
    another parser reads next (the tokenizers library's gives up at 128 levels, with a message of its own)."""
    try:
        raw = bounded(path, MAX_JSON, f"a {what} is a few KB of JSON (a few MB for the index of a very large model)")
    except OSError as e:
        raise UserError(f"{path}: not a readable JSON {what} ({first_line(e)[:200]})") from None
    return parsed(raw, path, what, max_depth)


def bounded(path: Path, limit: int, usual: str) -> bytes:
    """The file's bytes, or one line (ending in `usual`, what such a file holds) where it holds more than
    `limit`: at most limit + 1 bytes are read, so a huge file, or /dev/zero, is refused, not read whole.
    OSError is the caller's to say."""
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise UserError(f"{path}: more than {limit >> 20} MiB; {usual}")
    return raw


def parsed(raw: bytes, path: Path, what: str, max_depth: Optional[int] = None) -> Dict[str, Any]:
    """The JSON object in `raw` (the bytes of `path`, as `bounded` read them), checked as json_file checks it."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise UserError(f"{path}: nested deeper than Python's JSON parser goes ({sys.getrecursionlimit()} levels); "
                        f"a {what} is JSON a few levels deep") from None
    except ValueError as e:
        raise UserError(f"{path}: not a readable JSON {what} ({first_line(e)[:200]})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: holds {a_kind(value)}; a {what} is a JSON object")
    if max_depth is not None and depth(value) > max_depth:
        raise UserError(f"{path}: nested more than {max_depth} levels deep; a {what} is JSON a few levels deep")
    return value


def depth(value: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value (a scalar: 0), without recursing."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        todo.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest
