"""python -m launcher.export CHECKPOINT OUT [--format hf [--merge-lora] [--dtype bf16|fp32] [--max-shard-size 5GB]
                                             [--config FILE] [--tokenizer FOLDER]] [--format peft]

Any checkpoint the launcher writes, sharded or not, as one plain file of the unwrapped model's
state_dict, which loads into the plain model with load_state_dict(strict=True). No process group
is started: a sharded checkpoint's shards are read and joined in this process.

CHECKPOINT is a checkpoint folder (runs/<name>/checkpoints/step_<N>, written by any strategy; one in
an object store by its URL, s3://bucket/prefix/step_<N>), a run folder (its newest complete checkpoint,
else its model.pt), an HF model folder or a model state_dict file. OUT ends in .pt (torch.save) or
.safetensors. The checkpoint's CRC-32s are checked before anything is read.

--format hf writes OUT as a folder that HF's `from_pretrained` loads: config.json and safetensors shards
of at most --max-shard-size, with their index, read and written one shard at a time (never the whole
model in memory). The config is the model's own, which a run of an HF model keeps in
<run_dir>/hf_config.json (--config names another config.json). Beside them go the tokenizer's files
(tokenizer.json, tokenizer_config.json, the chat template, ...; copied as they are, checked first), so that
AutoTokenizer loads the folder too: those of the folder the run's tokenizer came from (its recipe.yaml's
data.train.tokenizer where that is a local folder, else its checkpoint.init_from where that folder holds a
tokenizer), or an HF folder's own (CHECKPOINT's); --tokenizer names another. Without one, the folder holds
the model alone, and a line says so. Of a LoRA run (peft), --merge-lora
merges the adapters into the base model's weights (W + B A x alpha / r, as peft's merge_and_unload), from
the adapter config the run keeps in <run_dir>/adapter_config.json.

--format peft writes a LoRA run's adapters alone as a folder PeftModel.from_pretrained loads
(adapter_config.json, adapter_model.safetensors).

Docs: docs/checkpoints.md#exporting-a-checkpoint (in the source tree).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from launcher.checkpoint import adapters, files, hf, hf_generation, hf_tokenizer, storage, untrusted, weights
from launcher.checkpoint.hf import RUN_CONFIG
from launcher.errors import UserError
from launcher.report import say

SUFFIXES = (".pt", ".safetensors")
FILE_SUFFIXES = SUFFIXES + (".bin", ".pth", ".ckpt")  # a name that says "a file": not a folder's


def write(state: Dict[str, torch.Tensor], out: Path) -> None:
    """One file, atomically (a temporary name, fsync, rename)."""
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save
        except ImportError:
            raise UserError("a .safetensors file needs the safetensors package: pip install 'launcher[export]' "
                            "(or pip install safetensors)") from None
        data = save(hf.unshared(state), metadata={"format": "pt"})
        files.write(out, lambda f: f.write(data), atomic=True)
    else:
        files.save(out, state, atomic=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=storage.location, help="a checkpoint folder (step_<N>, sharded or not; "
                                                                  "s3://bucket/prefix/step_<N> too), a run folder, "
                                                                  "or a model state_dict file")
    parser.add_argument("out", type=Path, help="the file to write: NAME.pt (torch.save) or NAME.safetensors; with "
                                               "--format hf, the folder to write")
    parser.add_argument("--format", choices=("file", "hf", "peft"), default="file",
                        help="file (default: one .pt or .safetensors file), hf (a folder from_pretrained loads) or "
                             "peft (a LoRA run's adapters as a folder PeftModel.from_pretrained loads)")
    parser.add_argument("--merge-lora", action="store_true", help="with --format hf, of a LoRA run: the adapters "
                                                                  "merged into the base model's weights")
    parser.add_argument("--dtype", choices=sorted(hf.DTYPES), help="with --format hf: the dtype of the floating-point "
                                                                  "weights written (default: as trained)")
    parser.add_argument("--max-shard-size", default="5GB", help="with --format hf: the largest safetensors file, "
                                                                 "as 5GB, 500MB or bytes (default 5GB)")
    parser.add_argument("--config", type=Path, help="with --format hf: the model's config.json (default: the run "
                                                    "folder's hf_config.json, or the HF folder's own)")
    parser.add_argument("--tokenizer", type=Path, help="with --format hf: the folder whose tokenizer files go beside "
                                                       "the model (default: the one the run's tokenizer came from)")
    args = parser.parse_args(argv)
    try:
        if storage.is_remote(args.checkpoint):
            storage.reachable(args.checkpoint, "CHECKPOINT")
        if not args.checkpoint.exists():
            raise UserError(f"{args.checkpoint}: no such file or folder")
        if args.format in ("hf", "peft") and args.out.suffix in FILE_SUFFIXES:
            raise UserError(f"{args.out}: --format {args.format} writes a folder, and this name ends in "
                            f"{args.out.suffix} as a file's does; name a folder (e.g. {args.out.with_suffix('')}), or "
                            f"leave --format out to write one {' or '.join(SUFFIXES)} file")
        if args.format == "hf":
            cfg, limit = _config(args.checkpoint, args.config), _bytes(args.max_shard_size)
        elif args.format == "file" and args.out.suffix not in SUFFIXES:
            raise UserError(f"{args.out}: the output must end in .pt or .safetensors (or give --format hf for a folder)")
        if args.merge_lora and args.format != "hf":
            raise UserError("--merge-lora: writes an HF folder; give --format hf with it")
        if args.tokenizer is not None and args.format != "hf":
            raise UserError("--tokenizer: its files go into an HF folder; give --format hf with it")
        if args.format == "hf":  # checked before any weight is written
            tokenizer, why = _tokenizer(args.checkpoint, args.tokenizer)
            beside = {**(hf_tokenizer.read(tokenizer) if tokenizer is not None else {}),
                      **_generation(args.checkpoint)}
        if args.format in ("hf", "peft"):  # read a shard at a time
            tensors, source = _adapted(*weights.lazy(args.checkpoint), args)
            specs = tensors.specs
        else:
            state, source = weights.read(args.checkpoint)
            specs = {k: (v.shape, v.dtype) for k, v in state.items()}
        try:
            if args.format == "hf":
                written = hf.write(args.out, tensors, cfg, hf.DTYPES.get(args.dtype), limit, beside=beside)
            elif args.format == "peft":
                written = adapters.write(args.out, tensors, _adapter_config(args.checkpoint), hf.DTYPES.get(args.dtype))
            else:
                write(state, args.out)
        except OSError as e:
            raise UserError(f"cannot write {args.out}: {e.strerror or e} (errno {e.errno})") from None
    except UserError as e:
        for problem in e.problems:
            say(problem)
        return 2
    parameters = sum(shape.numel() for shape, _ in specs.values())
    what = f" ({', '.join(written)})" if args.format != "file" else ""
    if args.format == "hf":
        print(hf_tokenizer.said(args.out, tokenizer, why))
    print(f"wrote {args.out}{what}: {len(specs)} tensors, {parameters:,} values, from {source}")
    return 0


def _adapted(tensors, source: str, args):
    """The tensors to write: a LoRA run's merged (--merge-lora) or its adapters alone (--format peft)."""
    lora = adapters.adapter_keys(tensors.specs)
    if args.format == "peft":
        if not lora:
            raise UserError(f"{args.checkpoint}: --format peft: the checkpoint holds no adapters (not a peft model's)")
        return adapters.adapters_only(tensors), source
    if args.merge_lora:
        if not lora:
            raise UserError(f"{args.checkpoint}: --merge-lora: the checkpoint holds no adapters (not a peft model's)")
        return adapters.merged(tensors, _adapter_config(args.checkpoint)), source
    if lora:
        raise UserError(f"{args.checkpoint}: a peft model's checkpoint (its adapters, {lora[0]!r}, ...): give "
                        f"--merge-lora for the base model with the adapters merged in, or --format peft for the "
                        f"adapters alone")
    return tensors, source


def _adapter_config(checkpoint: Path) -> dict:
    for folder in (checkpoint, checkpoint.parent.parent):
        kept = folder / adapters.RUN_CONFIG
        if kept.is_file():
            return untrusted.json_file(kept, "peft adapter config")
    raise UserError(f"{checkpoint}: the adapters' config was not found: a run of a peft model keeps it in "
                    f"<run_dir>/{adapters.RUN_CONFIG}; name the run folder or one of its checkpoints")


def _config(checkpoint: Path, given: Optional[Path]) -> dict:
    """The model's HF config: --config, else what the run kept (its run folder's hf_config.json, found from
    a run folder or one of its checkpoint folders), else an HF folder's own."""
    if given is not None:
        path = given / hf.CONFIG if given.is_dir() else given
        try:
            return untrusted.json_file(path, "config")
        except UserError as e:
            raise UserError(f"--config {e}") from None
    for folder in (checkpoint, checkpoint.parent.parent):
        kept = folder / RUN_CONFIG
        if kept.is_file():
            return untrusted.json_file(kept, "config")
    own = hf.config(checkpoint) if checkpoint.is_dir() else None
    if own is not None:
        return own
    raise UserError(f"{checkpoint}: --format hf needs the model's config, and none was found: a run of an HF model "
                    f"keeps it in <run_dir>/{RUN_CONFIG}; name one with --config FILE")


def _generation(checkpoint: Path) -> dict:
    """The generation config to write beside the model: the run's (in the run folder, found as its HF config is),
    else an HF folder's own; else none."""
    return {} if storage.is_remote(checkpoint) else hf_generation.kept(checkpoint, checkpoint.parent.parent)


def _tokenizer(checkpoint: Path, given: Optional[Path]):
    """The folder whose tokenizer files go beside the model, and why that one (or None, and why none): --tokenizer,
    else an HF folder's own, else the one the run's tokenizer came from (the recipe.yaml of the run folder
    CHECKPOINT is or is in)."""
    if given is not None:
        if not hf_tokenizer.holds(given.expanduser()):
            why = ("holds no tokenizer files (tokenizer.json, tokenizer_config.json: what a tokenizer's "
                   "save_pretrained writes)" if given.expanduser().is_dir() else "no such folder")
            raise UserError(f"--tokenizer {given}: {why}; name a folder holding a tokenizer")
        return given.expanduser(), "--tokenizer"
    if storage.is_remote(checkpoint):
        return None, "the run folder of a checkpoint in an object store is not known"
    if hf.holds(checkpoint) and hf_tokenizer.holds(checkpoint):
        return checkpoint, "the HF folder's own"
    for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if (folder / "recipe.yaml").is_file():
            found, why = hf_tokenizer.of_run(folder)
            return found, f"{why} in {folder / 'recipe.yaml'}"
    return None, f"no run recipe (recipe.yaml) in or above {checkpoint}"


def _bytes(size: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper())
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"--max-shard-size {size}: give a size such as 5GB, 500MB or 1000000 (bytes)")
    return int(float(match.group(1)) * units[match.group(2) or ""])


if __name__ == "__main__":
    sys.exit(main())
