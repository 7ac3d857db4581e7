"""python -m launcher.bench.checksum [--size recipe|124M] [--reps 5] [--folder DIR]

What the checkpoint CRC-32s cost, on a checkpoint of the charlm model (recipes/charlm.yaml) with AdamW's
state: `recipe` is the recipe's model (10.8M parameters, a 43 MB model.pt and an 86 MB state.pt),
`124M` the GPU benchmark's (126M parameters: 0.5 GB and 1 GB).

Writing: the launcher's save of model.pt and state.pt (CRC-32 computed on the bytes as torch.save
writes them, then fsync) against the same save through a plain file (fsync too). Resuming: the
launcher reads every file once more to check its CRC-32 before torch.load; that pass against the load
itself. Medians of --reps, alternating; the file system's page cache is warm, as it is for a resume
right after a save, so the check's time is the CRC-32's, not the disk's.

Docs: docs/performance.md#checksums (in the source tree).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from launcher.checkpoint import files
from recipes.components.gpt import GPT

SIZES = {"recipe": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
         "124M": dict(n_layer=10, n_head=16, n_embd=1024, block_size=1024)}


def run_state(size: str) -> tuple[dict, dict]:
    model = GPT(vocab_size=65, dropout=0.0, **SIZES[size])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # AdamW's two moments per parameter, as in any checkpoint after the first step
    return model.state_dict(), {"optimizer": optimizer.state_dict()}


def plain_save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m launcher.bench.checksum", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="recipe",
                        help="the charlm recipe's model (10.8M parameters) or the GPU benchmark's (126M) (default recipe)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions; the figures are their medians (default 5)")
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, state = run_state(args.size)
    params = sum(t.numel() for t in model.values())
    times = {k: [] for k in ("plain save", "save with CRC-32", "torch.load", "CRC-32 check")}
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        folder = Path(tmp)
        for _ in range(args.reps):
            for name, obj in (("model.pt", model), ("state.pt", state)):
                path = folder / name
                started = time.perf_counter()
                plain_save(obj, path)
                times["plain save"].append(time.perf_counter() - started)
                started = time.perf_counter()
                files.save(path, obj)
                times["save with CRC-32"].append(time.perf_counter() - started)
                started = time.perf_counter()
                torch.load(path, weights_only=True)
                times["torch.load"].append(time.perf_counter() - started)
                started = time.perf_counter()
                files.crc32(path)
                times["CRC-32 check"].append(time.perf_counter() - started)
        sizes = {name: (folder / name).stat().st_size for name in ("model.pt", "state.pt")}
    total = sum(sizes.values())

    def per_checkpoint(key: str) -> float:  # two files a checkpoint: the median pair
        values = times[key]
        return statistics.median(a + b for a, b in zip(values[::2], values[1::2]))

    print(f"charlm {args.size}: {params / 1e6:.1f}M parameters, model.pt {sizes['model.pt'] / 1e6:.0f} MB + "
          f"state.pt {sizes['state.pt'] / 1e6:.0f} MB; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"median of {args.reps}")
    save, crc_save = per_checkpoint("plain save"), per_checkpoint("save with CRC-32")
    load, check = per_checkpoint("torch.load"), per_checkpoint("CRC-32 check")
    print(f"save:   {save:.3f}s plain, {crc_save:.3f}s with CRC-32: +{crc_save - save:.3f}s "
          f"({100 * (crc_save / save - 1):+.1f}%)")
    print(f"resume: {load:.3f}s torch.load, +{check:.3f}s for the CRC-32 check ({100 * check / load:+.1f}%, "
          f"{total / check / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
