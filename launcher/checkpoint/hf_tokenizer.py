"""The tokenizer beside an exported HF folder, so that the folder is a whole model folder: AutoTokenizer and
AutoModelForCausalLM both load it, as they load what HF Trainer's save_model writes, and a next run (DPO after
SFT) names it alone.

Whose tokenizer: the folder the run's came from, as its recipe names it (the run folder's recipe.yaml, resolved):
data.train.tokenizer where that is a local folder, else checkpoint.init_from where that folder holds a
tokenizer's files; else none, and the export is the model alone (said, not a failure). Export's --tokenizer
names another.

Which files: those a tokenizer's save_pretrained writes (FILES: the fast tokenizer's JSON, the chat templates,
a slow tokenizer's vocabulary), copied byte for byte. They are untrusted input (DESIGN, invariant 13), checked as
launcher/data/text/tokenizer.py checks them before anything is copied: each read at most its bound, JSON parsed
within MAX_DEPTH levels and a template within MAX_TEMPLATE; nothing in them runs here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from launcher.data.text import tokenizer as tokenizers
from launcher.errors import UserError, first_line, short
from launcher.jsonfile import MAX_JSON, bounded, parsed

# A slow (Python) tokenizer's files, which transformers' save_pretrained writes beside tokenizer.json where the
# tokenizer has them: SentencePiece models, BPE vocabularies and merges, WordPiece vocabularies.
VOCABULARIES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt")
TEMPLATES = ("chat_template.jinja",)
FILES = tuple(tokenizers.JSON_FILES) + TEMPLATES + VOCABULARIES
JSON = {**tokenizers.JSON_FILES, "vocab.json": "vocabulary"}
# What makes a folder a tokenizer's: AutoTokenizer reads tokenizer_config.json first, the launcher tokenizer.json.
MARKS = ("tokenizer.json", "tokenizer_config.json")


def holds(folder: Path) -> bool:
    """Whether the folder holds a tokenizer's files."""
    return folder.is_dir() and any((folder / name).is_file() for name in MARKS)


def of_recipe(recipe: Any) -> Tuple[Optional[Path], str]:
    """The folder a run's tokenizer came from and the key that names it (a resolved recipe, as recipe.yaml
    holds it), or None and why none was found."""
    data = recipe.get("data") if isinstance(recipe, dict) else None
    train = data.get("train") if isinstance(data, dict) else None
    named = train.get("tokenizer") if isinstance(train, dict) else None
    checkpoint = recipe.get("checkpoint") if isinstance(recipe, dict) else None
    init_from = checkpoint.get("init_from") if isinstance(checkpoint, dict) else None
    for key, value in (("data.train.tokenizer", named), ("checkpoint.init_from", init_from)):
        if isinstance(value, str) and "://" not in value and holds(Path(value).expanduser()):
            return Path(value).expanduser(), key
    data_said = (f"data.train.tokenizer {short(named)} is no local tokenizer folder" if isinstance(named, str)
                 else "no data.train.tokenizer")
    init_said = (f"checkpoint.init_from {short(init_from)} holds no tokenizer files" if isinstance(init_from, str)
                 else "no checkpoint.init_from")
    return None, f"{data_said}, {init_said}"


def of_run(run_dir: Path) -> Tuple[Optional[Path], str]:
    """of_recipe of the recipe a run folder keeps (recipe.yaml), or None and why."""
    import yaml

    path = Path(run_dir) / "recipe.yaml"
    if not path.is_file():
        return None, f"no run recipe at {path}"
    try:
        recipe = yaml.safe_load(bounded(path, 1 << 20, "a run's recipe.yaml is a few KB of YAML"))
    except (OSError, ValueError, yaml.YAMLError) as e:
        return None, f"{path} cannot be read ({first_line(e)[:200]})"
    return of_recipe(recipe)


def read(folder: Path) -> Dict[str, bytes]:
    """The folder's tokenizer files (those of FILES it has, and additional_chat_templates/*.jinja), by the name
    each has in a model folder, checked as the launcher checks a tokenizer it loads; or one line naming the file."""
    named = [name for name in FILES if (folder / name).is_file()]
    named += [f"additional_chat_templates/{p.name}" for p in sorted(folder.glob("additional_chat_templates/*.jinja"))
              if p.is_file()]
    out = {}
    for name in named:
        path = folder / name
        try:
            if name.endswith(".jinja"):
                raw = bounded(path, tokenizers.MAX_TEMPLATE, "a chat template is a few KB of Jinja")
            else:
                raw = bounded(path, MAX_JSON, "a tokenizer's file is at most a few tens of MB")
        except OSError as e:
            raise UserError(f"{path}: cannot be read ({e.strerror or first_line(e)})") from None
        if name in JSON:
            parsed(raw, path, JSON[name], max_depth=tokenizers.MAX_DEPTH)
        out[name] = raw
    return out


def said(out: Path, folder: Optional[Path], why: str) -> str:
    """One line: where the export's tokenizer comes from, or that it has none."""
    if folder is not None:
        return f"tokenizer: {out} gets the tokenizer files of {folder} ({why})"
    return (f"tokenizer: none found ({why}): {out} holds the model alone; python -m launcher.export ... --format hf "
            f"--tokenizer FOLDER names one")


def checked(run_dir: Path) -> str:
    """At a run's start with checkpoint.export_hf (rank 0): the tokenizer <run_dir>/hf will get, its files
    checked now rather than found wanting once training is done; the line that says which."""
    folder, why = of_run(run_dir)
    if folder is not None:
        read(folder)
    return said(Path(run_dir) / "hf", folder, why)
