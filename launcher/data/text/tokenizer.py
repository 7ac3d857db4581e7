"""The tokenizer of a model folder, as `save_pretrained` writes it: `tokenizer.json` (the tokenizers library's
whole tokenizer) with `tokenizer_config.json` / `special_tokens_map.json` (its special tokens, its chat
template) and `chat_template.jinja`.

The folder is untrusted input (DESIGN, invariant 13): every JSON file that transformers reads from it is read
first by launcher/jsonfile.py (at most 64 MiB, within Python's parser's nesting and MAX_DEPTH levels, an
object), and a template file is size-capped, before transformers opens anything. It is then loaded as
transformers' generic fast tokenizer (`PreTrainedTokenizerFast`, its `TokenizersBackend`), not a class the
folder names: `tokenizer.json` as written (its normalizer, pre-tokenizer and post-processor: BOS where it adds
one), and no code of the folder's (an `auto_map`) is looked up or run. A chat template is rendered later by
transformers' sandboxed Jinja (ImmutableSandboxedEnvironment)."""

from __future__ import annotations

from pathlib import Path
import re
from typing import Any, Iterator, List, Optional, Tuple

from launcher.errors import UserError, first_line, short
from launcher.jsonfile import json_file

# What transformers' fast tokenizer reads from a folder as JSON (the model's config.json it does not), and what
# each is, for the line about it.
JSON_FILES = {"tokenizer.json": "tokenizer", "tokenizer_config.json": "tokenizer config",
              "special_tokens_map.json": "special tokens map", "added_tokens.json": "added tokens list",
              "chat_template.json": "chat template"}
# The tokenizers library's parser stops at 128 levels with a message of its own; real files nest under 10.
MAX_DEPTH = 32
MAX_TEMPLATE = 1 << 20  # the longest chat templates shipped with models are tens of KB of Jinja


def load(folder: str) -> Any:
    """The folder's tokenizer (a transformers PreTrainedTokenizerFast), or one line naming the folder."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise UserError(f"tokenizer: {folder}: no such folder; name a model folder as save_pretrained writes it "
                        f"(tokenizer.json with tokenizer_config.json)")
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"tokenizer: {path}: no tokenizer.json, so no tokenizer to read{_instead(path)}; a "
                        f"tokenizer's save_pretrained(folder) writes it (the launcher reads no other layout)")
    for name, what in JSON_FILES.items():
        if (path / name).is_file():
            read = json_file(path / name, what, max_depth=MAX_DEPTH)
            if name == "tokenizer.json":
                _check_regexes(read, path / name)
    for template in [path / "chat_template.jinja", *sorted(path.glob("additional_chat_templates/*.jinja"))]:
        if template.is_file() and template.stat().st_size > MAX_TEMPLATE:
            raise UserError(f"{template}: more than {MAX_TEMPLATE >> 20} MiB; a chat template is a few KB of Jinja")
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OSError, RecursionError) as e:
        raise UserError(f"tokenizer: {path}: transformers cannot read its tokenizer: {type(e).__name__}: "
                        f"{first_line(e)[:300]}") from None
    except Exception as e:  # the tokenizers library's own errors (a tokenizer.json it cannot take) are plain Exception
        if type(e) is not Exception:
            raise
        raise UserError(f"tokenizer: {path}/tokenizer.json: the tokenizers library cannot read it: "
                        f"{first_line(e)[:300]}") from None
    if tokenizer.eos_token_id is None:
        raise UserError(f"tokenizer: {path}: the tokenizer defines no EOS token (eos_token in tokenizer_config.json); "
                        f"samples end with it and text documents are joined by it")
    return tokenizer


def _check_regexes(whole: dict, file: Path) -> None:
    """Each regex the tokenizers library runs on text (a normalizer's, a pre-tokenizer's, a decoder's) repeats no
    group that can match in more than one way: Oniguruma backtracks through such a group exponentially, and the
    library panics past its limit (a Rust backtrace) or takes hours on a row just below it. The regexes shipped
    with models (GPT-2's, Llama 3's, Qwen's, Mistral's, DeepSeek's, o200k's) repeat single characters and
    classes only; a group they repeat, if any, is optional (`(?i:'s|'t)?`)."""
    for section in ("normalizer", "pre_tokenizer", "decoder"):
        for pattern in _regexes(whole.get(section)):
            group = repeated_choice(pattern)
            if group is not None:
                raise UserError(f"tokenizer: {file}: its {section.replace('_', '-')} regex {short(pattern)} "
                                f"repeats {short(group)}, a group that can match in more than one way: the "
                                f"tokenizers library backtracks through it exponentially (past its limit it panics, "
                                f"below it a row takes hours); repeat a character or a class instead, as the "
                                f"regexes of models' tokenizers do")


def _regexes(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += [v for k, v in item.items() if not (k == "Regex" and isinstance(v, str))]
            if isinstance(item.get("Regex"), str):
                yield item["Regex"]
        elif isinstance(item, list):
            stack += item


def repeated_choice(pattern: str) -> Optional[str]:
    """The first group of an Oniguruma `pattern` that is repeated (`*`, `+`, `{n}` of n > 1, `{n,}`, `{n,m}` of
    m > 1) and whose body can match in more than one way (it holds a quantifier or a `|`); None where none is."""
    frames = [[0, False]]  # each open group: where it starts, whether its body varies
    i = 0
    while i < len(pattern):
        c, closed = pattern[i], None
        if c == "\\":
            i += 2
            if pattern[i - 1:i] in ("p", "P", "x", "u", "k", "g") and pattern[i:i + 1] in ("{", "<"):
                i = _after(pattern, i, "}" if pattern[i] == "{" else ">")
        elif c == "[":
            i = _class_end(pattern, i)
        elif c == "(":
            frames.append([i, False])
            i += 1
            if pattern[i:i + 1] == "?":  # (?:  (?i:  (?=  (?<!  (?<name>: the group's kind, not an atom
                i = _after(pattern, i, ">") if pattern[i + 1:i + 2] == "<" and pattern[i + 2:i + 3] not in "=!" \
                    else i + 1 + len(pattern[i + 1:]) - len(pattern[i + 1:].lstrip("imxsWDSPya-:=!<>"))
            continue
        elif c == ")":
            closed = frames.pop() if len(frames) > 1 else [0, False]
            i += 1
        elif c == "|":
            frames[-1][1] = True
            i += 1
            continue
        else:
            i += 1
        repeats, i = _quantifier(pattern, i)
        if closed is not None and closed[1] and repeats == "many":
            return pattern[closed[0]:i]
        if repeats != "none" or (closed is not None and closed[1]):
            frames[-1][1] = True
    return None


def _quantifier(pattern: str, i: int) -> Tuple[str, int]:
    """What follows an atom at i: none, optional (?) or many, and where the pattern goes on after it."""
    c = pattern[i:i + 1]
    if c in ("*", "+", "?"):
        kind, i = ("optional" if c == "?" else "many"), i + 1
    elif c == "{" and re.match(r"\{(\d*),?(\d*)\}", pattern[i:]):
        found = re.match(r"\{(\d*)(,?)(\d*)\}", pattern[i:])
        low, comma, high = found.groups()
        most = int(high) if high else (None if comma else int(low or 0))
        kind, i = ("many" if most is None or most > 1 else "optional" if most == 1 else "none"), i + found.end()
    else:
        return "none", i
    return kind, i + (pattern[i:i + 1] in ("?", "+"))  # lazy or possessive


def _class_end(pattern: str, i: int) -> int:
    """Where the character class opening at i ends (Oniguruma's nest: [a-z&&[^aeiou]], [[:alpha:]])."""
    depth, start = 0, i
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            start = i
        elif c == "]" and i > start + 1 + (pattern[start + 1:start + 2] == "^"):
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _after(pattern: str, i: int, end: str) -> int:
    found = pattern.find(end, i)
    return len(pattern) if found < 0 else found + 1


def files(folder: str) -> List[Path]:
    """The files of the folder that make its tokenizer (those that exist): what a cache of its tokens is
    keyed by."""
    path = Path(folder).expanduser()
    named = [path / name for name in JSON_FILES] + [path / "chat_template.jinja"]
    return [p for p in named if p.is_file()] + sorted(path.glob("additional_chat_templates/*.jinja"))


def pad_id(tokenizer: Any) -> int:
    """The token that pads: the tokenizer's PAD, or EOS where it has none (as HF recipes set pad = eos)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def described(tokenizer: Any) -> str:
    """BOS '<s>' (0), EOS '</s>' (1), no PAD (EOS stands in for it): the tokens as the tokenizer defines them."""
    def one(name: str) -> Optional[str]:
        token, index = getattr(tokenizer, f"{name}_token"), getattr(tokenizer, f"{name}_token_id")
        return None if token is None else f"{name.upper()} {token!r} ({index})"

    named = [t for t in (one("bos"), one("eos"), one("pad")) if t]
    if tokenizer.bos_token is None:
        named.insert(0, "no BOS")
    if tokenizer.pad_token is None:
        named.append("no PAD (EOS stands in for it)")
    return ", ".join(named)


def chat_template(tokenizer: Any, given: Optional[str], folder: str) -> str:
    """The template that renders conversations: `given` (the recipe's Jinja, or a .jinja file), else the
    folder's own (its default one, where it has several)."""
    if given is not None:
        if _names_a_file(given):
            file = Path(given).expanduser()
            if not file.is_file():
                raise UserError(f"chat_template: {given}: no such file; give a Jinja template, or the path of a "
                                f".jinja file")
            if file.stat().st_size > MAX_TEMPLATE:
                raise UserError(f"{file}: more than {MAX_TEMPLATE >> 20} MiB; a chat template is a few KB of Jinja")
            return file.read_text(encoding="utf-8")
        return given
    own = tokenizer.chat_template
    if isinstance(own, dict):
        own = own.get("default")
    if not isinstance(own, str) or not own.strip():
        raise UserError(f"tokenizer: {folder}: the tokenizer has no chat template (chat_template.jinja, or "
                        f"chat_template in tokenizer_config.json); give one as the dataset's chat_template")
    return own


def template_origin(given: Optional[str], folder: str) -> str:
    """Where the template used comes from, for a line: its file, or the recipe's chat_template."""
    if given is not None:
        return given if _names_a_file(given) else "the recipe's chat_template"
    path = Path(folder).expanduser()
    found = [path / name for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
             if (path / name).is_file()]
    return str(found[0]) if found else str(path)


def _names_a_file(given: str) -> bool:
    """Whether the recipe's chat_template names a .jinja file (else it is the template's Jinja itself)."""
    return given.endswith(".jinja") and "{" not in given


def _instead(path: Path) -> str:
    found = [name for name in ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt") if (path / name).is_file()]
    return f" (it has {', '.join(found)}: a slow tokenizer's files, which the launcher does not convert)" if found else ""
