"""The gradients' average over the live groups, in buckets, as DDP's reducer does it: the parameters in reverse
order (about the order the backward makes their gradients), cut into buckets of DDP's sizes (1 MiB first, then
25 MiB) of one dtype and device each. In a group of one process, a post-accumulate-grad hook on each parameter
launches torchft's asynchronous all-reduce of a bucket as soon as the last backward of the step has made its
gradients, so the all-reduce runs while the backward goes on; `wait` launches what is left and waits for all.

Buckets are launched in their order on every group (a bucket ready before an earlier one waits for it), so that
each all-reduce meets the same bucket on the other groups whatever the backward's order and whichever parameters
a group's batch left without a gradient (those are zeros, launched in `wait`). Where the group has several
processes, its own reduction (ddp's, fsdp's reduce-scatter) ends with the backward: every bucket is launched in
`wait`, after it, from each rank's local shard of the gradients.

Each element is averaged as torchft does (the sum over the live groups, divided by their count): the buckets'
cut changes nothing of it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch.distributed.tensor import DTensor

FIRST_BUCKET = 2**20  # DDP's: a small first bucket starts the first all-reduce early in the backward
BUCKET = 25 * 2**20  # DDP's bucket_cap_mb


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: its local shard where it is a DTensor (a view: copied into, the DTensor has
    it)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Bucket:
    def __init__(self, params: List[torch.Tensor]):
        self.params = params
        self.ready = 0
        self.launched: Optional[tuple] = None  # (the gradients, their flat copy, torchft's work)


def buckets(params: List[torch.Tensor], first: int = FIRST_BUCKET, cap: int = BUCKET) -> List[Bucket]:
    """`params` in reverse order, cut where a bucket would pass its size or change dtype or device."""
    made: List[List[torch.Tensor]] = []
    size, limit = 0, first
    for q in reversed(params):
        part = local(q)
        nbytes = part.numel() * part.element_size()
        if not made or (size and size + nbytes > limit) or (part.dtype, part.device) != _kind(made[-1][-1]):
            if made:
                limit = cap
            made.append([])
            size = 0
        made[-1].append(q)
        size += nbytes
    return [Bucket(b) for b in made]


def _kind(q: torch.Tensor) -> tuple:
    part = local(q)
    return part.dtype, part.device


class Average:
    """The average of `params`' gradients over the live groups through `allreduce` (torchft's Manager.allreduce:
    a tensor, averaged in place, to a work). `overlap`: launch each bucket from the backward (a group of one
    process, whose gradients are final as the backward makes them)."""

    def __init__(self, params: List[torch.Tensor], allreduce: Callable[[torch.Tensor], Any], overlap: bool,
                 first: int = FIRST_BUCKET, cap: int = BUCKET):
        self.allreduce = allreduce
        self.buckets = buckets(params, first, cap)
        self.of: Dict[torch.Tensor, Bucket] = {}
        self.armed = False
        self.next = 0  # the first bucket not launched yet
        if overlap:
            for bucket in self.buckets:
                for q in bucket.params:
                    self.of[q] = bucket
                    q.register_post_accumulate_grad_hook(self._made)

    def arm(self) -> None:
        """The next backward is the step's last: its gradients are averaged as it makes them."""
        for bucket in self.buckets:
            bucket.ready, bucket.launched = 0, None
        self.next, self.armed = 0, True

    def _made(self, q: torch.Tensor) -> None:
        if not self.armed:  # an accumulation micro-step's backward, or one outside training
            return
        bucket = self.of[q]
        bucket.ready += 1
        while self.next < len(self.buckets) and self._complete(self.buckets[self.next]):
            self._launch(self.buckets[self.next])

    @staticmethod
    def _complete(bucket: Bucket) -> bool:
        return bucket.ready == len(bucket.params)

    def _launch(self, bucket: Bucket) -> None:
        for q in bucket.params:
            if q.grad is None:  # a parameter this group's batch did not reach: the others' may have
                q.grad = torch.zeros_like(q)
        grads = [local(q.grad) for q in bucket.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        bucket.launched = (grads, flat, self.allreduce(flat))
        self.next += 1

    def wait(self) -> None:
        """After the step's last backward: the buckets not launched yet launched, in order, and every bucket's
        average waited for; it is the gradients from then on. A failure is kept by the manager (its commit says
        it)."""
        self.armed = False
        while self.next < len(self.buckets):
            self._launch(self.buckets[self.next])
        for bucket in self.buckets:
            grads, flat, work = bucket.launched
            work.wait()
            for q, grad, averaged in zip(bucket.params, grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                if q.grad is grad:  # a plain gradient becomes its view of the bucket: no copy back (freed with it)
                    q.grad = averaged
                else:  # a DTensor's local shard, copied into
                    grad.copy_(averaged)
            bucket.launched = None
