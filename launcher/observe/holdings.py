"""What one rank holds of a model in training: its parameters, their gradients and the optimizer's state,
counted as the rank's own shares (a DTensor's local shard, a tied parameter once). Metadata only: no
device is read. The line it makes ends a multi-process run; `python -m launcher.bench` reads it."""

from __future__ import annotations

from typing import Dict, Iterable

import torch

MIB = 2**20


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Bytes of this rank's parameters, of their gradients (one per trainable parameter, as backward makes
    them: the gradients may be freed now), and of the optimizer's state."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"parameters": _local_bytes(params), "gradients": _local_bytes(p for p in params if p.requires_grad),
            "optimizer state": _local_bytes(state)}


def line(rank: int, held_bytes: Dict[str, int]) -> str:
    parts = ", ".join(f"{name} {size / MIB:.{2 if size >= MIB else 4}f} MiB" for name, size in held_bytes.items())
    return f"memory on rank {rank}: {parts} (its own shares)"
