"""One rank's memory at the peak of a training step, found by running the step on fake tensors.

The recipe's model, optimizer, step and precision are built as a run builds them, the model on the meta
device (its initialisation reads no values), then its parameters allocated inside torch's `FakeTensorMode`:
tensors have shapes, dtypes and storages of a size, and no memory. The batch is real, and what is made of it
alone (launcher/plan/standins.py says what else stands in for a run's kernels). Distributed layouts run as
rank 0 of a fake process group of their world size (torch's `fake` backend: collectives return at once), so
FSDP2 shards, HSDP, tensor parallel and expert parallel split exactly as they would (ep's routing assumed:
launcher/plan/standins.py). torch's memory trackers
(`torch.distributed._tools`: MemTracker, FSDPMemTracker) count each live storage by kind while two optimizer
steps run in the loop's order (the second holds the optimizer state through its forward and backward: that
is where steady training peaks). DDP's buckets, which no tracker sees, are added by launcher/plan/peaks.py."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from launcher.errors import UserError, first_line
from launcher.plan.layouts import Layout

KINDS = ("parameters", "gradients", "optimizer", "activations", "temporaries")
# the trackers' reference types, by kind
_KIND_OF = {"PARAM": "parameters", "SHARDED_PARAM": "parameters", "BUFFER": "parameters", "GRAD": "gradients",
            "SHARDED_GRAD": "gradients", "UNSHARDED_GRAD": "gradients", "OPT": "optimizer", "ACT": "activations",
            "INP": "activations", "TEMP": "temporaries", "OTH": "temporaries", "UNSHARDED_PARAM": "temporaries",
            "ALL_GATHER": "temporaries", "REDUCE_SCATTER": "temporaries"}


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
    """The model or its step does an operation fake tensors cannot run: `row` says so for one layout's row,
    the message for the whole plan (where every layout meets it)."""

    def __init__(self, message: str, row: str = ""):  # (unpickled from a worker with its message alone)
        super().__init__(message)
        self.row = row or message


def peaks(recipe, layout: Layout, batches: List[Any], device_type: str, keep: Optional[int]) -> tuple:
    """The peaks of rank 0 under `layout` with each of `batches` (no DDP buckets), and the bytes of the trainable
    parameters, with the model's stack cut to `keep` blocks (None: whole)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.checkpoint import CheckpointError

    from launcher.model import empty
    from launcher.plan.standins import quiet, standing_in

    sharded = layout.strategy == "fsdp"
    with _world(layout.world) if sharded else contextlib.nullcontext(), quiet():
        strategy = _strategy(recipe, layout)
        try:
            # wrapped outside fake mode: FSDP2 and tensor parallel make device meshes of real rank numbers
            model = _model(recipe, layout, strategy, keep=keep)
            with FakeTensorMode(allow_non_fake_inputs=True):
                empty.materialise(model, torch.device("cpu"))
                strategy.after_forward(model)
                with standing_in(device_type, layout.capacity):
                    return _run(recipe, layout, strategy, model, batches, device_type)
        except UserError:
            raise
        except Exception as e:  # an operation with no fake (meta) kernel, one that reads a parameter's values
            why = f"{type(e).__name__}: {first_line(e)}"
            row = f"its training step fails on fake tensors under this layout ({why})"
            if isinstance(e, CheckpointError):  # (a run fails alike)
                row = f"its blocks cannot recompute their activations ({why})"
            raise NotFake(f"model: {recipe.model.get('_target_')}: its training step cannot run on fake tensors "
                          f"({why}); the plan needs every operation of the step to have a meta kernel and no step "
                          f"to read the values of a tensor made from the model's on the host", row) from None


def stack(model: torch.nn.Module) -> Optional[tuple]:
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
    parallel = dataclasses.replace(recipe.parallel, tp=layout.tp, dp_replicate=layout.dp_replicate, pp=1,
                                   ep=layout.ep)
    strategy = strategies.create(name, placement, recipe.ddp, recipe.fsdp, parallel=parallel)
    if name == "fsdp":  # its setup, less the rendezvous: the mesh is made outside fake mode
        strategy.shape = mesh.layout(layout.tp, layout.dp_replicate, layout.world, ep=layout.ep)
        strategy.device_mesh = mesh.device_mesh(strategy.shape, "cpu")
        if layout.ep > 1:
            strategy.experts_mesh = mesh.experts_mesh(strategy.device_mesh, strategy.shape)
    strategy.settle(recipe.precision, recipe.trainer.grad_accum_steps)
    return strategy


def _model(recipe, layout: Layout, strategy, keep: Optional[int] = None) -> torch.nn.Module:
    """The recipe's model as the run builds it, on the meta device (its blocks recomputing under +ac), its stack
    cut to `keep` blocks where given, wrapped by the strategy."""
    from launcher.model import recompute

    model = on_meta(recipe)
    if keep:
        parent, name = stack(model)
        setattr(parent, name, torch.nn.ModuleList(list(getattr(parent, name))[:keep]))
    setting = recipe.trainer.activation_checkpointing or ("auto" if layout.recompute else None)
    if setting:
        recompute.apply(model, recompute.chosen(model, setting))
    return strategy.wrap(model)


def on_meta(recipe) -> torch.nn.Module:
    """The recipe's model with its parameters on the meta device. One that cannot be built so is said as the
    planner's (a run builds it with memory), with the reason."""
    from launcher.model import empty
    from launcher.run import build

    try:
        with empty.parameters_on_meta():
            return build.component(recipe.model, "model")
    except UserError as e:
        why = f"cannot be built on the meta device, as the plan builds it ({e.problems[0]})"
        raise NotFake(f"model: {recipe.model.get('_target_')}: {why}", why) from None


def _run(recipe, layout: Layout, strategy, model, batches: List[Any], device_type: str) -> tuple:
    """(the peak of a step with each of `batches`, the bytes of the trainable parameters): what `peaks` returns."""
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
    train_step(batches[0])
    found = []
    for batch in batches:
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


