"""The checkpoint formats, in the order a folder is recognised: a new format is a module with the same
functions (see full.py) and one entry here.

Each format module has NAME and holds(folder) (is this folder of mine?); model_weights(folder) (the plain
model's weights, for export and init_from, once the folder's files are checked as the format checks
them); lazy_weights(folder) (the same as hf.Tensors, read a few at a time: export --format hf); and, where runs write and resume it, save(checkpoints, step, final), read_run_state(checkpoints,
folder) and load(checkpoints, folder). A format that runs only read (an HF model folder, say) has the
first four alone."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from launcher.checkpoint import full, hf, sharded
from launcher.errors import UserError

FORMATS = (sharded, full, hf)


def of(folder: Path) -> ModuleType:
    """The format of a checkpoint folder."""
    for kind in FORMATS:
        if kind.holds(folder):
            return kind
    raise UserError(f"{folder}: not a complete checkpoint (no valid manifest.json); name a step_<N> folder that has "
                    f"one (formats read: {', '.join(f.NAME for f in FORMATS)})")


def written_by(strategy) -> ModuleType:
    """The format a strategy's runs write: shards where the state is sharded, else rank 0's full files."""
    return sharded if strategy.sharded else full
