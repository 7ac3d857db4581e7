"""python -m launcher.export CHECKPOINT OUT

Any checkpoint the launcher writes, sharded or not, as one plain file of the unwrapped model's
state_dict, which loads into the plain model with load_state_dict(strict=True). No process group
is started: a sharded checkpoint's shards are read and joined in this process.

CHECKPOINT is a checkpoint folder (runs/<name>/checkpoints/step_<N>, written by any strategy), a run
folder (its newest complete checkpoint, else its model.pt) or a model state_dict file. OUT ends in
.pt (torch.save) or .safetensors. The checkpoint's CRC-32s are checked before anything is read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from launcher import checkpoint, sharded
from launcher.errors import UserError

SUFFIXES = (".pt", ".safetensors")


def model_state(path: Path) -> Tuple[Dict[str, torch.Tensor], str]:
    """The plain model's weights in `path` (a checkpoint folder, a run folder or a file), and what they were
    read from."""
    path = Path(path)
    if path.is_dir() and ((path / "checkpoints").is_dir() or (path / "recipe.yaml").is_file()):
        path = _in_run_folder(path)
    if path.is_dir():
        return checkpoint_weights(path), str(path)
    state = checkpoint.load_file(path)
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise UserError(f"{path}: not a model state_dict (a mapping of parameter names to tensors)")
    checkpoint.check_against_manifest(path)
    return checkpoint.strip_prefixes(state), str(path)


def checkpoint_weights(folder: Path) -> Dict[str, torch.Tensor]:
    """The model's weights of a checkpoint folder of either kind, once its files match their CRC-32s."""
    if not checkpoint.is_complete(folder):
        raise UserError(f"{folder}: not a complete checkpoint (no valid manifest.json); name a step_<N> folder that "
                        f"has one")
    problem = checkpoint.verify(folder)
    if problem is not None:
        raise UserError(f"{folder}: damaged ({problem}); use another checkpoint")
    if not sharded.is_sharded(folder):
        return checkpoint.strip_prefixes(checkpoint.load_file(folder / "model.pt"))
    return sharded.model_weights(folder)


def _in_run_folder(folder: Path) -> Path:
    """A run folder's newest weights: its newest complete checkpoint (a finished run's last one holds what its
    model.pt holds; a run continued and killed later holds newer ones than a model.pt left from before), else
    its model.pt."""
    found = checkpoint.complete(folder / "checkpoints")
    if found:
        return found[-1]
    if (folder / "model.pt").is_file():
        return folder / "model.pt"
    raise UserError(f"{folder}: a run folder without a model.pt or a complete checkpoint")


def write(state: Dict[str, torch.Tensor], out: Path) -> None:
    """One file, atomically (a temporary name, fsync, rename)."""
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save
        except ImportError:
            raise UserError("a .safetensors file needs the safetensors package: pip install 'launcher[export]' "
                            "(or pip install safetensors)") from None
        data = save(_unshared(state), metadata={"format": "pt"})
        checkpoint.write_file(out, lambda f: f.write(data))
    else:
        checkpoint.write_file(out, lambda f: torch.save(state, f))


def _unshared(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): each later alias becomes a copy of
    its own, so every key is in the file and loads with strict=True (the model ties them again)."""
    seen, out = set(), {}
    for key, tensor in state.items():
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[key] = tensor.clone().contiguous() if where in seen else tensor.contiguous()
        seen.add(where)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    from launcher.cli import _say

    parser = argparse.ArgumentParser(prog="python -m launcher.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (step_<N>, sharded or not), a run folder, "
                                                      "or a model state_dict file")
    parser.add_argument("out", type=Path, help="the file to write: NAME.pt (torch.save) or NAME.safetensors")
    args = parser.parse_args(argv)
    try:
        if args.out.suffix not in SUFFIXES:
            raise UserError(f"{args.out}: the output must end in .pt or .safetensors")
        if not args.checkpoint.exists():
            raise UserError(f"{args.checkpoint}: no such file or folder")
        state, source = model_state(args.checkpoint)
        try:
            write(state, args.out)
        except OSError as e:
            raise UserError(f"cannot write {args.out}: {e.strerror or e} (errno {e.errno})") from None
    except UserError as e:
        for problem in e.problems:
            _say(problem)
        return 2
    parameters = sum(t.numel() for t in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {parameters:,} values, from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
