"""What crosses between pipeline stages outside torch's schedules: a batch as the keyword arguments the schedules
split into micro-batches (and back into the batch's own form on each stage), and an activation sent to the next
stage with a header of its shape and dtype (evaluation runs the stages one after another, whatever the batch's
shape, without a schedule that would need to know it in advance)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Tuple

import torch
import torch.distributed as dist

from launcher.errors import UserError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HEADER = 8  # dimensions (up to 6), then the dtype's place in DTYPES


def send(tensor: torch.Tensor, to: int) -> None:
    header = torch.tensor([tensor.dim(), *tensor.shape, *[0] * (HEADER - 2 - tensor.dim()), DTYPES.index(tensor.dtype)],
                          dtype=torch.int64, device=tensor.device)
    dist.send(header, to)
    dist.send(tensor.contiguous(), to)


def receive(source: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, source)
    dims = header.tolist()
    tensor = torch.empty(dims[1:1 + dims[0]], dtype=DTYPES[dims[-1]], device=device)
    dist.recv(tensor, source)
    return tensor


def tensors(batch: Any) -> List[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else []
    return [v for v in values if isinstance(v, torch.Tensor)]


def as_keywords(batch: Any) -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], Any]]:
    """The batch as keyword arguments the schedules split into micro-batches (along the first dimension), and how
    a stage puts a micro-batch back into the batch's form."""
    if isinstance(batch, Mapping):
        keys = list(batch)
        return {f"k{i}": batch[k] for i, k in enumerate(keys)}, lambda kw: {k: kw[f"k{i}"] for i, k in enumerate(keys)}
    if isinstance(batch, (tuple, list)):
        kind = type(batch)
        return ({f"k{i}": v for i, v in enumerate(batch)},
                lambda kw: kind(kw[f"k{i}"] for i in range(len(batch))))
    if isinstance(batch, torch.Tensor):
        return {"k0": batch}, lambda kw: kw["k0"]
    raise UserError(f"parallel.pp: a batch is {type(batch).__name__}, which the pipeline cannot split into "
                    f"micro-batches; give batches of tensors (a tensor, a tuple or a mapping of them)")
