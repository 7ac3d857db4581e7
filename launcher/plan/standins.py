"""What a run does that fake tensors, left to themselves, would do otherwise: `standing_in(device_type)` holds
them while the planner's step runs.

- **The batch's values.** A model may read its batch on the host: whether any token is padded decides whether
  an attention mask is made at all (transformers sums the padding mask, and takes a fake tensor for one whose
  sum it cannot know: it makes the mask). The batch stays real, and an operation on real tensors alone (a
  padding mask, its sum, the count of scored labels) runs on them, where it makes no more than VALUES_UP_TO
  bytes; whatever meets a parameter is fake.
- **Attention.** On fake tensors `scaled_dot_product_attention` takes its math path, which keeps the
  attention weights for backward; a run takes a fused kernel where one takes its arguments (flash or
  memory-efficient on CUDA; flash on the CPU, which has none with dropout), which keeps their log-sum-exp
  alone. The fused CPU kernel's fake counterpart stands for it, given what a run gives it: a boolean mask as
  the float mask torch makes of it, grouped keys and values unrepeated.
- **Grouped matrix products** (a mixture of experts' layers): the fake kernel of `grouped_mm` takes bf16
  alone, where the CPU's kernel takes any float. In another dtype a stand-in makes what the kernel makes:
  the output, and in backward the gradients of input and weights.
- **Routing under expert parallelism.** Each MoE layer's dispatch (launcher/parallel/experts.py) reads on the
  host how many (token, expert) pairs go to each rank of the ep group: what the router decides from values fake
  tensors do not have. The plan assumes them (`shares`): each rank sends its pairs evenly over the group, and
  its experts receive `capacity` times an even share of the group's (1: as many as its own tokens make; ep: all
  of them); the rest of the dispatch (the all-to-alls' buffers, the experts' own forward on what was received)
  runs as in a run.
- **torch's log** of a fake kernel that failed (a traceback per model) is `quiet()`: the planner says the
  failure in one line."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator

import torch

VALUES_UP_TO = 64 * 2**20  # bytes an operation on the batch alone may make real


@contextlib.contextmanager
def standing_in(device_type: str, capacity: float = 1.0) -> Iterator[None]:
    with _fused_attention(device_type), _grouped_mm(), _routed(capacity), _BatchValues():
        yield


class _BatchValues:
    """Inside (under a FakeTensorMode), operations on real tensors alone run on them (see the module)."""

    def __enter__(self):
        from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                                   UnsupportedOperatorException, is_fake, unset_fake_temporarily)
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                if not tensors or any(is_fake(t) for t in tensors):  # (a DTensor of fake shards too)
                    return func(*args, **kwargs)
                if func._schema.is_mutable:  # writes into its real inputs: nothing new
                    with unset_fake_temporarily():
                        return func(*args, **kwargs)
                try:
                    out = func(*args, **kwargs)  # fake: its size, before anything is allocated
                except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException):
                    out = None  # it reads a value (item(), nonzero) or has no fake kernel: it runs on the values
                made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                if sum(t.numel() * t.element_size() for t in made) > VALUES_UP_TO:
                    return out
                with unset_fake_temporarily():
                    return func(*args, **kwargs)

        self.mode = Mode()
        return self.mode.__enter__()

    def __exit__(self, *args):
        return self.mode.__exit__(*args)


@contextlib.contextmanager
def _fused_attention(device_type: str) -> Iterator[None]:
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p > 0 and device_type == "cpu":  # the math path, as the run's
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        try:
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, -math.inf)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        except (RuntimeError, TypeError, ValueError):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class _GroupedProduct(torch.autograd.Function):
    """grouped_mm's memory: (S, in) @ (E, in, out) -> (S, out); backward makes (S, in) and (E, in, out)."""

    @staticmethod
    def forward(ctx, input, weight, offs):
        ctx.save_for_backward(input, weight)
        return input.new_empty(input.shape[0], weight.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        return torch.empty_like(input), torch.empty_like(weight), None


@contextlib.contextmanager
def _grouped_mm() -> Iterator[None]:
    import torch.nn.functional as F

    from torch._subclasses.fake_tensor import is_fake

    held = [(owner, name, getattr(owner, name)) for owner, name in ((F, "grouped_mm"), (torch, "_grouped_mm"))
            if hasattr(owner, name)]

    def standing(original):
        def grouped(mat_a, mat_b, *args, offs=None, **kwargs):
            plain = not args and not kwargs and offs is not None and mat_a.dim() == 2 and mat_b.dim() == 3
            if plain and is_fake(mat_a) and mat_a.dtype != torch.bfloat16:
                return _GroupedProduct.apply(mat_a, mat_b, offs)
            return original(mat_a, mat_b, *args, offs=offs, **kwargs)
        return grouped

    for owner, name, original in held:
        setattr(owner, name, standing(original))
    try:
        yield
    finally:
        for owner, name, original in held:
            setattr(owner, name, original)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    log = logging.getLogger("torch._subclasses.fake_tensor")
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


@contextlib.contextmanager
def _routed(capacity: float) -> Iterator[None]:
    from launcher.parallel import experts

    original = experts.split_sizes

    def assumed(ranks: torch.Tensor, ep: int, group) -> tuple:
        return shares(ranks.numel(), ep, capacity)

    experts.split_sizes = assumed
    try:
        yield
    finally:
        experts.split_sizes = original


def shares(pairs: int, ep: int, capacity: float) -> tuple:
    """(the pairs this rank sends to each rank of its ep group, those it receives from each) when every rank
    routes `pairs` and this one receives `capacity` times an even share of the group's (at most all of them)."""
    received = min(round(capacity * pairs), ep * pairs)
    return _even(pairs, ep), _even(received, ep)


def _even(n: int, parts: int) -> list:
    return [n // parts + (i < n % parts) for i in range(parts)]
