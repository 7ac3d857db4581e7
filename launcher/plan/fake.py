"""One rank's memory at the peak of a training step, found by running the step on fake tensors.

The recipe's model, optimizer, step and precision are built as a run builds them, but inside torch's
`FakeTensorMode`: tensors have shapes, dtypes and storages of a size, and no memory. Distributed layouts
run as rank 0 of a fake process group of their world size (torch's `fake` backend: collectives return at
once), so FSDP2 shards, HSDP and tensor parallel split exactly as they would. torch's memory trackers
(`torch.distributed._tools`: MemTracker, FSDPMemTracker) count each live storage by kind while two
optimizer steps run in the loop's order (the second holds the optimizer state through its forward and
backward: that is where steady training peaks).

DDP's own memory is its all-reduce buckets, which its C++ reducer allocates and fills outside any
tracker's sight (and it cannot run on fake tensors): a ddp layout is the single step plus one bucket byte
per trainable parameter byte, or with `ddp.gradient_as_bucket_view` the gradients held for good in the
buckets instead of freed between steps."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from launcher.errors import UserError, first_line

KINDS = ("parameters", "gradients", "optimizer", "activations", "temporaries")
# the trackers' reference types, by kind
_KIND_OF = {"PARAM": "parameters", "SHARDED_PARAM": "parameters", "BUFFER": "parameters", "GRAD": "gradients",
            "SHARDED_GRAD": "gradients", "UNSHARDED_GRAD": "gradients", "OPT": "optimizer", "ACT": "activations",
            "INP": "activations", "TEMP": "temporaries", "OTH": "temporaries", "UNSHARDED_PARAM": "temporaries",
            "ALL_GATHER": "temporaries", "REDUCE_SCATTER": "temporaries"}


@dataclass(frozen=True)
class Layout:
    """How the ranks share the model: a strategy over `world` ranks, the fsdp mesh's tp and dp_replicate, and
    whether the model's blocks recompute their activations."""

    strategy: str  # single | ddp | fsdp
    world: int = 1
    tp: int = 1
    dp_replicate: int = 1
    recompute: bool = False

    @property
    def replicas(self) -> int:
        """The ranks that read a share of the batch of their own."""
        return self.world // self.tp

    @property
    def name(self) -> str:
        if self.strategy in ("single", "ddp"):
            return self.strategy if self.world == 1 else f"{self.strategy} x{self.world}"
        shard = self.world // (self.tp * self.dp_replicate)
        parts = ([f"hsdp {self.dp_replicate}x{shard}"] if self.dp_replicate > 1 else [f"fsdp x{shard}"] if shard > 1
                 else [])
        if self.tp > 1:
            parts.append(f"tp x{self.tp}")
        return " ".join(parts or ["fsdp x1"]) + (" +ac" if self.recompute else "")

    def overrides(self) -> List[str]:
        """The command line's keys for this layout."""
        out = [f"strategy={self.strategy}"]
        if self.strategy != "single":
            out.append(f"nproc_per_node={self.world}")
        if self.tp > 1:
            out.append(f"parallel.tp={self.tp}")
        if self.dp_replicate > 1:
            out.append(f"parallel.dp_replicate={self.dp_replicate}")
        if self.recompute:
            out.append("trainer.activation_checkpointing=auto")
        return out


@dataclass
class Peak:
    """The bytes one rank holds at its peak, by kind."""

    by_kind: Dict[str, int]
    running: int = 0  # the peak while the model runs forward and backward (what grows with the micro-batch)
    backward: Optional[Dict[str, int]] = None  # the bytes by kind at the peak of backward
    forward: Optional[Dict[str, int]] = None  # ... at the peak of forward
    outside: Optional[Dict[str, int]] = None  # ... at the peak outside forward and backward (the optimizer's step)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


class NotFake(UserError):
    """The model or its step does an operation fake tensors cannot run."""


def peak(recipe, layout: Layout, batch: Any, device_type: str) -> Peak:
    return peaks(recipe, layout, [batch], device_type)[0]


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
    depth = _depth(recipe) if shallow else None
    if depth is None or depth <= shallow[1] + 2:
        found, trainable = _peaks(recipe, layout, batches, device_type, None)
    else:
        (low, low_bytes), (high, high_bytes) = (_peaks(recipe, layout, batches, device_type, keep) for keep in shallow)

        def line(a: float, b: float) -> int:
            return max(0, round(a + (b - a) * (depth - shallow[0]) / (shallow[1] - shallow[0])))

        found = [_deeper(a, b, line) for a, b in zip(low, high)]
        trainable = line(low_bytes, high_bytes)
    if layout.strategy == "ddp":
        found = [_with_buckets(p, trainable, recipe.ddp.gradient_as_bucket_view) for p in found]
    return found


def _peaks(recipe, layout: Layout, batches: List[Any], device_type: str, keep: Optional[int]) -> tuple:
    """The peaks (no DDP buckets), and the bytes of the trainable parameters, with the model's stack cut to
    `keep` blocks (None: whole)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sharded = layout.strategy == "fsdp"
    with _world(layout.world) if sharded else contextlib.nullcontext():
        strategy = _strategy(recipe, layout)
        try:
            # Sharded, the model is built on the meta device and wrapped outside fake mode (FSDP2 and tensor
            # parallel make device meshes of real rank numbers), then its shards are allocated as fake tensors.
            model = _model(recipe, layout, strategy, on_meta=True, keep=keep) if sharded else None
            with FakeTensorMode(allow_non_fake_inputs=True) as mode, _fused_attention():
                if sharded:
                    from launcher.model import empty

                    empty.materialise(model, torch.device("cpu"))
                    strategy.after_forward(model)
                else:
                    model = _model(recipe, layout, strategy, on_meta=False, keep=keep)
                return _run(recipe, layout, strategy, model, mode, batches, device_type)
        except UserError:
            raise
        except Exception as e:  # an operation with no fake (meta) kernel, or one that reads tensor values
                raise NotFake(f"model: {recipe.model.get('_target_')}: its training step cannot run on fake tensors "
                              f"({type(e).__name__}: {first_line(e)}); the plan needs every operation of the step "
                              f"to have a meta kernel and no step to read a tensor's values on the host") from None


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


def _depth(recipe) -> Optional[int]:
    """The number of blocks in the model's stack (None: it has none), from the model built on meta."""
    from launcher.model import empty
    from launcher.run import build

    try:
        with empty.parameters_on_meta():
            found = _stack(build.component(recipe.model, "model"))
    except UserError:
        raise
    except Exception:  # planned whole, where the error is said
        return None
    return len(getattr(*found)) if found else None


def _stack(model: torch.nn.Module) -> Optional[tuple]:
    """(parent, name) of the model's largest ModuleList of two or more blocks of one class and one shape."""
    best, most = None, 0
    for parent in model.modules():
        for name, child in parent.named_children():
            if not isinstance(child, torch.nn.ModuleList) or len(child) < 2:
                continue
            shapes = {(type(b), tuple((n, tuple(q.shape)) for n, q in b.named_parameters())) for b in child}
            elements = sum(q.numel() for q in child.parameters())
            if len(shapes) == 1 and elements > most:
                best, most = (parent, name), elements
    return best


@contextlib.contextmanager
def _fused_attention():
    """On fake tensors torch's scaled_dot_product_attention takes its math path, which keeps the attention
    weights for backward; a run takes a fused kernel (flash, on CUDA and on the CPU), which keeps their
    log-sum-exp alone. Inside, the fused CPU kernel's fake counterpart runs (where it takes the arguments)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        try:
            if enable_gqa and key.shape[-3] != query.shape[-3]:
                groups = query.shape[-3] // key.shape[-3]
                key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
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


@contextlib.contextmanager
def _world(world: int):
    """A default process group of `world` ranks, this one rank 0, whose collectives do nothing."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the fake backend

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _strategy(recipe, layout: Layout):
    from launcher import strategies
    from launcher.parallel import mesh
    from launcher.placement.scheduler import Placement

    name = "single" if layout.strategy == "ddp" else layout.strategy  # ddp: the single step, and its buckets
    world = layout.world if name == "fsdp" else 1
    placement = Placement(world_size=world, local_world_size=world, launched_by="torchrun" if world > 1 else "plain")
    parallel = dataclasses.replace(recipe.parallel, tp=layout.tp, dp_replicate=layout.dp_replicate, pp=1)
    strategy = strategies.create(name, placement, recipe.ddp, recipe.fsdp, parallel=parallel)
    if name == "fsdp":  # its setup, less the rendezvous: the mesh is made outside fake mode
        strategy.shape = mesh.layout(layout.tp, layout.dp_replicate, layout.world)
        strategy.device_mesh = mesh.device_mesh(strategy.shape, "cpu")
    strategy.settle(recipe.precision, recipe.trainer.grad_accum_steps)
    return strategy


def _model(recipe, layout: Layout, strategy, on_meta: bool, keep: Optional[int] = None) -> torch.nn.Module:
    """The recipe's model as the run builds it (its blocks recomputing under +ac), its stack cut to `keep`
    blocks where given, wrapped by the strategy."""
    from launcher.model import empty, recompute
    from launcher.run import build

    with empty.parameters_on_meta() if on_meta else contextlib.nullcontext():
        model = build.component(recipe.model, "model")
    if keep:
        parent, name = _stack(model)
        setattr(parent, name, torch.nn.ModuleList(list(getattr(parent, name))[:keep]))
    setting = recipe.trainer.activation_checkpointing or ("auto" if layout.recompute else None)
    if setting:
        recompute.apply(model, recompute.chosen(model, setting))
    return strategy.wrap(model)


def _run(recipe, layout: Layout, strategy, model, mode, batches: List[Any], device_type: str) -> List[Peak]:
    from torch.utils._pytree import tree_map_only

    from launcher.model.precision import Precision
    from launcher.model.step import result
    from launcher.run import build

    params = [q for q in model.parameters() if q.requires_grad]
    optimizer, _ = build.optimizer(recipe.optimizer, params)
    step = build.step(recipe.step, recipe.loss)
    precision = Precision(recipe.precision, torch.device("cpu"))
    free_after_step = device_type == "cuda"
    accum = min(recipe.trainer.grad_accum_steps, 2)

    def train_step(batch, tracker=None) -> None:  # the loop's order (launcher/run/loop.py), one or two micro-batches
        for micro in range(accum):
            if tracker is not None:  # the backward that reduces the gradients is the last micro-batch's
                tracker.backward = {}
            with strategy.no_sync(model, skip=micro + 1 < accum), precision.autocast():
                out = result(step(model, batch))  # held through backward, as the loop holds it for the metrics
            if micro == 0 and not free_after_step:
                optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            del out
        optimizer.step()
        if free_after_step:
            optimizer.zero_grad(set_to_none=True)

    # A first step, untracked, makes the optimizer's state (and, on fake tensors, caches of its own that a run
    # does not have); each step tracked after it holds that state through its forward and backward, as every
    # step of a run after its first: the steady peak.
    fakes = [tree_map_only(torch.Tensor, mode.from_tensor, batch) for batch in batches]
    train_step(fakes[0])
    found = []
    for batch in fakes:
        found.append(_tracked(lambda tracker: train_step(batch, tracker), model, optimizer, batch,
                              layout.strategy == "fsdp"))
    return found, sum(q.numel() * q.element_size() for q in params)


def _tracked(run, model, optimizer, batch, sharded: bool) -> Peak:
    """The peak of `run()` by kind, as torch's tracker counts it."""
    from torch.utils._pytree import tree_flatten

    from launcher.observe import memory

    # the batch counted: a run's is made in its step
    tracker = memory.tracker(model, optimizer, sharded, *[t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)])
    with tracker:
        run(tracker)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    running = tracker.running or snapshot.get("Total", 0)  # the peak while the model ran forward or backward
    return Peak(_kinds(snapshot), running, _kinds(tracker.backward), _kinds(tracker.forward), _kinds(tracker.outside))


def _kinds(snapshot: Dict[Any, int]) -> Dict[str, int]:
    by_kind = dict.fromkeys(KINDS, 0)
    for ref, size in snapshot.items():
        kind = _KIND_OF.get(getattr(ref, "name", str(ref)))
        if kind:
            by_kind[kind] += size
    return by_kind


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


def micro_batches(items: List[Any], size: int) -> List[Any]:
    """`size` items from a rank's first ones, repeated as often as needed: a micro-batch of that size."""
    return (items * math.ceil(size / len(items)))[:size]
