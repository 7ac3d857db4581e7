"""Batches on the device: a batch's tensors moved, however the batch nests them, and a loader's batches handed
out one by one, each moving where training stands as it goes.

`to_device(batch, device)` moves every tensor of a batch (tuples, named tuples, lists, mappings, dataclasses);
on the CPU it is the batch itself. `placed(data, position)` hands out `data.host_batches(position)` on the
device, and on CUDA copies batch n+1 from pinned memory on a side stream while batch n computes. Both the
sampled data (launcher/data/sampling.py) and streams (launcher/data/stream.py) hand out their batches so.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

import torch


def placed(data, position) -> Iterator[Any]:
    """`data`'s batches on the device; as each is handed out, `position` (and the data's own place) moves
    to it, so a checkpoint taken between two batches resumes with the next one."""
    batches = data.host_batches(position)
    if data.device.type == "cuda":
        batches = _copied_ahead(batches, data.device)
    for place, batch in batches:
        data.arrive(place, position)
        yield batch


def _copied_ahead(batches: Iterator[tuple], device: torch.device) -> Iterator[tuple]:
    """Batch n+1 is copied from pinned memory to the GPU on a side stream while batch n computes.
    No host sync: the compute stream waits on the copy stream on the device."""
    copy, compute = torch.cuda.Stream(device), torch.cuda.current_stream(device)

    def start(item: tuple) -> tuple:
        place, batch = item
        with torch.cuda.stream(copy):
            return place, to_device(batch, device)

    ahead = start(next(batches))
    for item in batches:
        current = ahead
        compute.wait_stream(copy)  # before the next copy is queued: wait for this batch's only
        each_tensor(current[1], lambda t: t.record_stream(compute))  # made on the copy stream: freed after use here
        ahead = start(item)
        yield current


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a batch's tensors to the device; asynchronous from pinned memory on CUDA."""
    if device.type == "cpu":
        return batch
    return each_tensor(batch, lambda t: t.to(device, non_blocking=True))


def each_tensor(batch: Any, fn) -> Any:
    """`batch` with `fn` applied to each tensor in it, through tuples, named tuples, lists, mappings and
    dataclasses, however nested; any other leaf (a string, an id) is kept as it is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(each_tensor(b, fn) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(each_tensor(b, fn) for b in batch)
    if isinstance(batch, Mapping):
        moved = {k: each_tensor(v, fn) for k, v in batch.items()}
        if type(batch) is dict:
            return moved
        try:  # keep the mapping's type (an OrderedDict, HF's BatchEncoding) where it can be rebuilt
            return type(batch)(moved)
        except Exception:
            return moved
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: each_tensor(getattr(batch, f.name), fn)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch
