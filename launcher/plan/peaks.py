"""The peak of a layout: the step on fake tensors (launcher/plan/fake.py), a deep stack of blocks planned at two
shallow depths and extrapolated to its own, and DDP's buckets, which no tracker sees, added.

DDP's own memory is its all-reduce buckets, which its C++ reducer allocates and fills outside any tracker's
sight (and it cannot run on fake tensors): a ddp layout is the single step plus one bucket byte per trainable
parameter byte, or with `ddp.gradient_as_bucket_view` the gradients held for good in the buckets instead of
freed between steps."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from launcher.errors import UserError
from launcher.plan import fake
from launcher.plan.fake import KINDS, Peak
from launcher.plan.layouts import Layout

SHALLOW = (3, 6)  # the depths a model of more repeated blocks is planned at, then extrapolated to its own


def peaks(recipe, layout: Layout, batches: List[Any], device_type: str, shallow: Optional[tuple] = SHALLOW) -> List[Peak]:
    """The peak of rank 0 under `layout` with each of `batches` (micro-batches of that rank, on the host), on a
    device of `device_type` (where the loop frees the gradients: after the step on CUDA, after the next
    forward on the CPU).

    A model whose largest part is a stack of identical blocks (a transformer's layers) more than
    `shallow[1] + 2` deep is planned with its stack cut to each of the `shallow` depths, and each kind's bytes
    at the peaks of forward, of backward and of the optimizer's step extrapolated in a line to its own depth
    (_deeper): every block adds the same parameters, gradients, optimizer state and activations, and the time
    of fake tensors grows with the operations run."""
    blocks = depth(recipe) if shallow else None
    if blocks is None or blocks <= shallow[1] + 2:
        found, trainable = fake.peaks(recipe, layout, batches, device_type, None)
    else:
        (low, low_bytes), (high, high_bytes) = (fake.peaks(recipe, layout, batches, device_type, keep)
                                                for keep in shallow)

        def line(a: float, b: float) -> int:
            return max(0, round(a + (b - a) * (blocks - shallow[0]) / (shallow[1] - shallow[0])))

        found = [_deeper(a, b, line) for a, b in zip(low, high)]
        trainable = line(low_bytes, high_bytes)
    if layout.strategy == "ddp":
        found = [_with_buckets(p, trainable, recipe.ddp.gradient_as_bucket_view) for p in found]
    return found


def _deeper(low: Peak, high: Peak, line) -> Peak:
    """The peak of the whole depth from those of two shallower ones: the peaks of forward, of backward and of
    the optimizer's step, each kind on its line; the highest of the three is the peak."""
    def kinds(a: Optional[Dict[str, int]], b: Optional[Dict[str, int]]) -> Dict[str, int]:
        a, b = a or {}, b or {}
        return {k: line(a.get(k, 0), b.get(k, 0)) for k in KINDS}

    forward, backward, outside = (kinds(getattr(low, n), getattr(high, n)) for n in ("forward", "backward", "outside"))
    by_kind = max(forward, backward, outside, key=lambda found: sum(found.values()))
    running = max(sum(forward.values()), sum(backward.values()))
    return Peak(by_kind, running, backward, forward, outside)


def depth(recipe) -> Optional[int]:
    """The number of blocks in the model's stack (None: it has none), from the model built on meta."""
    try:
        found = fake.stack(fake.on_meta(recipe))
    except UserError:
        raise
    except Exception:  # planned whole, where the error is said
        return None
    return len(getattr(*found)) if found else None


def _with_buckets(found: Peak, buckets: int, as_view: bool) -> Peak:
    """DDP's peak from one process's. Its buckets hold a copy of every trainable parameter's gradient for good,
    and its backward one more while it reduces them (torch's tracker sees it in a real run: tests/test_plan.py);
    with gradient_as_bucket_view the buckets are the gradients' own storage, which then is never freed."""
    if as_view:
        out = dict(found.by_kind, gradients=buckets)
        return Peak(out, found.running + sum(out.values()) - found.total)
    steady = dict(found.by_kind)
    steady["temporaries"] += buckets
    backward = dict(found.backward or found.by_kind)
    backward["temporaries"] += 2 * buckets
    out = max(steady, backward, key=lambda kinds: sum(kinds.values()))
    return Peak(out, max(found.running + buckets, sum(backward.values())))
