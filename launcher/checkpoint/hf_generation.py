"""The generation config beside an exported HF folder (generation_config.json), as `save_pretrained` writes it
for a model that generates: `generate` and pipelines read from it how a turn ends (Llama 3's instruct models
name <|eot_id|> as an end token there alone) and the sampling defaults the model was published with.

Which: kept in the run folder when the run builds its model (rank 0), and written beside the weights by every
HF export of the run (checkpoint.export_hf, python -m launcher.export --format hf): the generation_config.json of
the folder the model came from (checkpoint.init_from, else a local `pretrained_model_name_or_path` in the recipe's
model section), copied byte for byte once checked as untrusted input (read within a bound, parsed as JSON a few
levels deep; nothing in it runs); else the model's own generation config, where it generates, as save_pretrained
would write it; else none."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from launcher.checkpoint import files, hf
from launcher.errors import UserError, first_line
from launcher.jsonfile import bounded, parsed

FILE = "generation_config.json"
MAX_BYTES = 1 << 20  # a generation config is a few hundred bytes
MAX_DEPTH = 8


def source(init_from: Any, model_spec: Any) -> Optional[Path]:
    """The local folder holding the generation config of the model a recipe builds (its checkpoint.init_from and
    model section), or None."""
    for where in (init_from, *(value for _, value in hf.named_folders(model_spec, "model"))):
        if isinstance(where, str) and "://" not in where and (Path(where).expanduser() / FILE).is_file():
            return Path(where).expanduser()
    return None


def read(folder: Path) -> bytes:
    """The folder's generation_config.json, checked; or one line naming it."""
    path = folder / FILE
    try:
        raw = bounded(path, MAX_BYTES, "a generation config is a few hundred bytes of JSON")
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or first_line(e)})") from None
    parsed(raw, path, "generation config", max_depth=MAX_DEPTH)
    return raw


def of_model(model) -> Optional[bytes]:
    """A model's own generation config as save_pretrained writes it (only what differs from the defaults), where
    the model generates; else None."""
    can = getattr(model, "can_generate", None)
    config = getattr(model, "generation_config", None)
    if not (callable(can) and can()) or not callable(getattr(config, "to_json_string", None)):
        return None
    return config.to_json_string(use_diff=True).encode()


def keep(run_dir: Path, init_from: Any, model_spec: Any, model) -> None:
    """What the run's HF exports write beside the weights (rank 0, once the run has built its model)."""
    folder = source(init_from, model_spec)
    raw = read(folder) if folder is not None else of_model(model)
    if raw is not None:
        files.write(run_dir / FILE, lambda f: f.write(raw), atomic=True)


def kept(*folders: Path) -> Dict[str, bytes]:
    """The generation config of the first of `folders` holding one (a run folder, an HF folder), by its name in a
    model folder, checked (a run folder is the user's too); empty where none holds one."""
    for folder in folders:
        if (folder / FILE).is_file():
            return {FILE: read(folder)}
    return {}
