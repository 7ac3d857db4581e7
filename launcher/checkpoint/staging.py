"""A state's tensors copied to host memory, so that a checkpoint is written while training changes them:
the buffers are kept from one save to the next (a save waits for the one before it, so they are free
again), page-locked when the tensors are on a GPU, as torchtitan's `async_with_pinned_mem` stages.

Tensors that share memory (tied weights) share one copy, as torch.save would keep them."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch


class Staging:
    def __init__(self) -> None:
        self.buffers: Dict[Tuple[Any, ...], torch.Tensor] = {}

    def copy(self, state: Any) -> Any:
        """`state` with every tensor replaced by its host copy (dicts, lists and tuples rebuilt; other
        values, which the state holds as immutable numbers and strings, kept)."""
        self._shared: Dict[Tuple[Any, ...], torch.Tensor] = {}
        self._cuda = False
        copied = self._copy(state, ())
        if self._cuda:
            torch.cuda.synchronize()  # the non-blocking copies are done before the writer reads them
        return copied

    def _copy(self, value: Any, where: Tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value.detach(), where)
        if isinstance(value, dict):
            return {k: self._copy(v, (*where, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, (*where, i)) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    def _tensor(self, t: torch.Tensor, where: Tuple[Any, ...]) -> torch.Tensor:
        same = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and same in self._shared:
            return self._shared[same]
        buffer = self.buffers.get(where)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self.buffers[where] = buffer
        buffer.copy_(t, non_blocking=t.is_cuda)
        self._cuda |= t.is_cuda
        if t.numel():
            self._shared[same] = buffer
        return buffer
