"""The memory planner beside a run: the run's own peak measured over one step (torch's tracker on the CPU, the
allocator on CUDA), and `python -m launcher.plan` for the run's layout started on rank 0 at the first log step;
both figures said side by side at the last step. Advisory: whatever the planner does, the run goes on."""

from __future__ import annotations

from typing import Dict, Optional

from launcher.observe import memory
from launcher.recipe import Loaded
from launcher.recipe.schema import Recipe
from launcher.run.loop import Parts

PLANNED = ("single", "ddp", "fsdp")  # the strategies python -m launcher.plan plans


def measure(recipe: Recipe, parts: Parts, model) -> None:
    """Measure the run's peak over one step (parts.measured), where the planner can plan its layout."""
    from launcher.parallel import experts

    strategy, device = parts.strategy, parts.strategy.device
    experts.routed_to = None  # (a run before this one's, in the same process)
    # torch's tracker on the CPU sees the operations of eager code: a compiled step's kernels pass it by, so a
    # compiled run on the CPU is not checked (on CUDA the allocator counts every kernel's memory)
    compiled_on_cpu = recipe.trainer.compile and device.type != "cuda"
    if recipe.parallel.cp > 1 and recipe.logging.memory_plan:
        parts.console.info("logging.memory_plan: python -m launcher.plan does not plan parallel.cp's layouts yet; this "
                           "run is not planned")
        return
    if recipe.trainer.loss_chunk and recipe.logging.memory_plan:
        parts.console.info("logging.memory_plan: python -m launcher.plan does not plan trainer.loss_chunk yet; this "
                           "run is not planned")
        return
    if strategy.name in PLANNED and recipe.logging.memory_plan and not compiled_on_cpu:
        buckets = memory.ddp_buckets(model, recipe.ddp.gradient_as_bucket_view) if strategy.name == "ddp" else 0
        parts.measured = memory.Measured(parts.model, parts.optimizer, device, strategy.sharded, buckets)
        parts.watch.windows.append(parts.measured)
        if recipe.parallel.ep > 1:
            experts.routed_to = parts.measured.route


def planned(loaded: Loaded, parts: Parts) -> Optional[memory.Planned]:
    """The planner for this run's layout, started beside training on rank 0 at the first log step; its figure is
    said at the first log step after it is ready, and at the last step beside the measured peak (where it is not
    ready by then, the run does not wait for it unless logging.memory_plan is `wait`)."""
    strategy, setting = parts.strategy, loaded.recipe.logging.memory_plan
    if not (setting and strategy.placement.is_main and parts.measured is not None):
        return None
    planned = memory.Planned(loaded.path, loaded.overrides, strategy.name, strategy.placement.world_size,
                             strategy.device.type)
    idle = parts.idle

    def said_when_ready() -> None:
        idle()
        if _measured_first(parts, planned):
            planned.start()  # at the first log step: the run's start has every core
        if not planned.said and planned.ready():
            planned.said = True
            parts.console.info(planned.result(wait=False)[1])

    parts.idle = said_when_ready
    parts.closing = lambda: _said(parts, planned, wait=setting == "wait")
    return planned


def _measured_first(parts: Parts, planned: memory.Planned) -> bool:
    """Whether the planner may start: on the CPU once the step is measured, given its micro-batch's length and
    under ep the pairs its experts received over an even share (the step's figure is that batch's and that
    routing's; the plan would be the longest batch's, routed evenly). CUDA's allocator keeps the whole run's
    peak: the longest batch's, which the planner plans without being told."""
    measured = parts.measured
    if measured.device.type == "cuda":
        return True
    if measured.bytes is None:
        return False
    planned.as_measured(measured.length, measured.capacity())
    return True


def _said(parts: Parts, planned: memory.Planned, wait: bool) -> Dict[str, float]:
    """At the last step: the measured peak beside the planned one, said, and for the loggers."""
    measured = parts.measured.peak()  # (its step's end, where it is the last: before the planner starts)
    _measured_first(parts, planned)
    figure, line = planned.result(wait=wait or planned.ready())
    values = {} if measured is None else {"memory/peak_bytes": float(measured)}
    how = f"{measured / 2**20:.1f} MiB per rank at the peak ({parts.measured.how()})" if measured is not None else ""
    if figure is not None:
        values["memory/predicted_peak_bytes"] = float(figure)
    if figure is not None and measured:
        parts.console.info(f"memory: {how}; planned {figure / 2**20:.1f} MiB (python -m launcher.plan"
                           f"{planned.assuming()}), "
                           f"{100 * (figure - measured) / measured:+.1f}%")
    elif line is None:  # not planned yet: the measured figure alone (logging.memory_plan=wait waits for the plan)
        if how:  # a figure alone says nothing of what to do: the planner says which devices it fits
            parts.console.info(f"memory: {how}; which layouts fit N devices of a size, and their largest micro-batch: "
                               f"{planned.sizing}")
    else:
        parts.console.info(line + (f"; measured {how}" if how else ""))
    return values
