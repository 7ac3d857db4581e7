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
from typing import Dict, List, Optional

import torch

from launcher.checkpoint import files, weights
from launcher.errors import UserError
from launcher.report import say

SUFFIXES = (".pt", ".safetensors")


def write(state: Dict[str, torch.Tensor], out: Path) -> None:
    """One file, atomically (a temporary name, fsync, rename)."""
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save
        except ImportError:
            raise UserError("a .safetensors file needs the safetensors package: pip install 'launcher[export]' "
                            "(or pip install safetensors)") from None
        data = save(_unshared(state), metadata={"format": "pt"})
        files.write(out, lambda f: f.write(data), atomic=True)
    else:
        files.save(out, state, atomic=True)


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
        state, source = weights.read(args.checkpoint)
        try:
            write(state, args.out)
        except OSError as e:
            raise UserError(f"cannot write {args.out}: {e.strerror or e} (errno {e.errno})") from None
    except UserError as e:
        for problem in e.problems:
            say(problem)
        return 2
    parameters = sum(t.numel() for t in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {parameters:,} values, from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
