"""A recipe file read as YAML. Every way a file can fail to be a recipe (not text, not UTF-8, not YAML,
nested too deeply, a key given twice) is one line naming the file and, where there is one, the line.

Why the checks before OmegaConf: PyYAML's composer and OmegaConf's walks recurse once per nesting
level (libyaml's C composer, which OmegaConf uses, crashes the interpreter on ~100000 levels instead of
raising), and OmegaConf's message for a duplicate key names neither its section nor where it was first.

The nesting is counted on the event stream of PyYAML's own pure-Python parser, a state machine that
recurses nowhere, whichever libyaml the wheel bundles: PyYAML 6.0.4's libyaml refuses deep nesting with
a ScannerError before its first event, and any later one may draw its line elsewhere.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.errors import UserError, first_line

MAX_BYTES = 1 << 20  # recipes are a few KB; OmegaConf refuses more than 10000 values anyway
MAX_DEPTH = 32  # recipes nest three or four levels; this keeps every recursive walk far from Python's limit


class TooDeep(Exception):
    """YAML nested more than MAX_DEPTH levels (aliases followed); `line` is where it gets too deep."""

    def __init__(self, line: int):
        super().__init__(f"nested more than {MAX_DEPTH} levels deep")
        self.line = line


def read(path: Path) -> tuple[dict, Dict[str, int]]:
    """The file's mapping (interpolations unresolved), and the line of each dotted key in it."""
    text = _decode(path, _read_bytes(path))
    try:
        node = compose(text)
    except TooDeep as e:
        raise UserError(f"{path}:{e.line}: {e}; a recipe's sections nest a few levels (is this the recipe "
                        f"file?)") from None
    except yaml.YAMLError as e:
        raise UserError(f"{_where(path, text, e)}: not valid YAML: {problem(e)}") from None
    if node is None:
        return {}, {}
    if not isinstance(node, yaml.MappingNode):
        kind = "list" if isinstance(node, yaml.SequenceNode) else "single value"
        raise UserError(f"{path}: a recipe is a mapping of keys (name:, model:, ...), not a {kind}")
    lines: Dict[str, int] = {}
    duplicates: List[str] = []
    _walk(node, "", lines, duplicates, set())
    if duplicates:
        raise UserError(*(f"{path}:{d}" for d in duplicates))
    try:
        data = OmegaConf.create(text)
    except (yaml.YAMLError, OmegaConfBaseException, ValueError) as e:  # ValueError: an integer of >4300 digits
        raise UserError(f"{_where(path, text, e)}: {problem(e)}") from None
    return OmegaConf.to_container(data, resolve=False), lines


def compose(text: str) -> Optional[yaml.Node]:
    """yaml.compose, raising TooDeep before anything recursive meets deep nesting (YAMLError if not YAML)."""
    depth = 0
    # Not yaml.CSafeLoader: its libyaml is the wheel's, and its limits are not ours (module docstring). A
    # YAMLError here is the one the composer would raise at the same token, no deeper than MAX_DEPTH.
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise TooDeep(event.start_mark.line + 1)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    # An alias nests its whole anchored value once more (or itself): count levels over distinct nodes,
    # each remembering the line of the top-level value it hangs from (where the alias is used).
    level = [(node, 0)] if node is not None else []
    for _ in range(MAX_DEPTH + 1):
        children: Dict[int, tuple] = {}
        for parent, line in level:
            inside = parent.value if isinstance(parent, yaml.SequenceNode) else (
                [c for pair in parent.value for c in pair] if isinstance(parent, yaml.MappingNode) else [])
            for child in inside:
                children.setdefault(id(child), (child, line or child.start_mark.line + 1))
        if not children:
            return node
        level = list(children.values())
    raise TooDeep(level[0][1])


def _read_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # bounded: /dev/zero or a huge file is refused, not read whole
    except FileNotFoundError:
        raise UserError(f"{path}: recipe file not found") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the recipe: {e.strerror or e}") from None
    if len(raw) > MAX_BYTES:
        raise UserError(f"{path}: more than {MAX_BYTES // 2**20} MiB; a recipe is a few KB of YAML (is this the "
                        f"recipe file?)")
    return raw


def _decode(path: Path, raw: bytes) -> str:
    head = raw[:8192]
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or (b"\x00" in head and _utf16(head)):
        raise UserError(f"{path}: UTF-16 or UTF-32 text; save the recipe as UTF-8")
    if b"\x00" in head:
        kind = ("a zip archive (a torch.save file?)" if raw.startswith(b"PK\x03\x04")
                else "a pickle (a torch.save file?)" if raw.startswith(b"\x80") else "binary data")
        raise UserError(f"{path}: {kind}, not a YAML recipe; name the recipe's .yaml file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: byte {raw[e.start]:#04x} is not UTF-8 (Latin-1 or another "
                        f"encoding?); save the recipe as UTF-8") from None


def _utf16(head: bytes) -> bool:
    """ASCII text in UTF-16 (or 32) without a byte order mark: every other byte is zero."""
    even, odd = head[0:64:2], head[1:64:2]
    return bool(head) and (even.count(0) == len(even) or odd.count(0) == len(odd))


def _walk(node: Any, prefix: str, lines: Dict[str, int], duplicates: List[str], seen: set) -> None:
    """Record each dotted key's line; report a key given twice in one mapping, which PyYAML would
    silently take the last of. An aliased node is walked once."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, child in enumerate(node.value):
            _walk(child, f"{prefix}{i}.", lines, duplicates, seen)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first: Dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<:` merges are OmegaConf's to resolve; a non-scalar key is reported by OmegaConf
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key_node.value in first:
            duplicates.append(f"{line}: {key}: duplicate key (first at line {first[key_node.value]}); "
                              f"give each key once")
            continue
        first[key_node.value] = line
        lines[key] = line
        _walk(value_node, key + ".", lines, duplicates, seen)


def _where(path: Path, text: str, e: Exception) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is not None:
        return f"{path}:{mark.line + 1}"
    position = getattr(e, "position", None)  # a ReaderError: a character YAML does not allow
    return f"{path}:{text.count(chr(10), 0, position) + 1}" if isinstance(position, int) else str(path)


def problem(e: Exception) -> str:
    """What a YAML error says is wrong, without its context lines."""
    return first_line(getattr(e, "problem", None) or e)
