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
from typing import Any, List, Optional

from launcher.errors import UserError, first_line
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
            json_file(path / name, what, max_depth=MAX_DEPTH)
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
