"""`python -m launcher recipe.yaml strategy=ddp` outside torchrun: start torchrun in this process.

This reuses torch.distributed.run (torchrun itself) rather than re-implementing it: the
workers are `python -m launcher` with the same recipe and overrides, on one node.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from launcher.errors import UserError


def process_count(nproc_per_node: Optional[int], visible_gpus: int, device: str) -> int:
    if nproc_per_node:
        return nproc_per_node
    if device != "cpu" and visible_gpus > 0:
        return visible_gpus
    raise UserError("nproc_per_node: strategy=ddp on the CPU starts torchrun for you and needs a process "
                    "count; add nproc_per_node=N (or start it with torchrun --nproc_per_node=N -m launcher ...)")


def torchrun(recipe: Path, overrides: List[str], nproc: int) -> int:
    """Run the recipe under torchrun with `nproc` workers; the exit code of the first failed worker, else 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "launcher", str(recipe), *overrides])
    try:
        run(args)
    except ChildFailedError as e:
        # The workers have said what went wrong; torchrun's own report would repeat it for each rank.
        _, first = e.get_first_failure()
        return first.exitcode if first.exitcode and first.exitcode > 0 else 1
    return 0
