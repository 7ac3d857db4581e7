"""The checkpoint formats, in the order a folder is recognised: a new format is a module with the same
functions (see full.py) and one entry here.

Each format module has NAME and holds(folder) (is this folder of mine?); model_weights(folder) (the plain
model's weights, for export and init_from, once the folder's files are checked as the format checks
them); lazy_weights(folder) (the same as hf.Tensors, read a few at a time: export --format hf); and, where runs write and resume it, save(checkpoints, step, final, background), read_run_state(checkpoints,
folder) and load(checkpoints, folder). A format that runs only read (an HF model folder, say) has the
first four alone."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Optional

from launcher.checkpoint import full, hf, sharded
from launcher.errors import UserError

FORMATS = (sharded, full, hf)


def of(folder: Path) -> ModuleType:
    """The format of a checkpoint folder."""
    for kind in FORMATS:
        if kind.holds(folder):
            return kind
    raise UserError(_not_held(folder) or f"{folder}: not a complete checkpoint (no valid manifest.json); name a "
                    f"step_<N> folder that has one (formats read: {', '.join(f.NAME for f in FORMATS)})")


def _not_held(folder: Path) -> Optional[str]:
    """What an HF model folder that no format holds lacks, or None for a folder that is not one."""
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    if shards and not (folder / hf.INDEX).is_file():
        return (f"{folder}: safetensors shards ({shards[0]}, ...) without {hf.INDEX}, which names the shard of each "
                f"tensor; copy it from where the shards came from (save_pretrained writes it beside them)")
    pickled = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    if pickled:
        return (f"{folder}: holds {pickled[0]}, which is not read (a pickle can run code as it loads); convert the "
                f"folder to safetensors once, e.g. AutoModelForCausalLM.from_pretrained(FOLDER).save_pretrained(OUT, "
                f"safe_serialization=True), and name OUT")
    if (folder / hf.CONFIG).is_file() and not hf.holds(folder):
        return (f"{folder}: {hf.CONFIG} without the weights an HF model folder holds beside it ({hf.SINGLE}, or "
                f"shards with {hf.INDEX})")
    if ((folder / hf.SINGLE).is_file() or (folder / hf.INDEX).is_file()) and not (folder / hf.CONFIG).is_file():
        single = folder / hf.SINGLE
        alone = f"; to read the weights alone, name the file ({single})" if single.is_file() else ""
        return f"{folder}: weights without the {hf.CONFIG} an HF model folder holds beside them{alone}"
    return None


def written_by(strategy) -> ModuleType:
    """The format a strategy's runs write: shards where the state is sharded, else rank 0's full files."""
    return sharded if strategy.sharded else full
