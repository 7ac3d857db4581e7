"""Recording windows the recipe asks for: a torch.profiler trace (`profile:`) and CUDA's allocator
history (`memory_snapshot:`), each over a few steps, into the run folder; and the out-of-memory report.

The loop calls `Watch.start(step, total)` before its first step and `Watch.at(step)` at the end of each
step (`step`: the last step done, its logging, evaluation and checkpoint included). Outside a window
that is one integer comparison: nothing else runs and nothing is recorded. A window is clipped to the
steps this run makes (a resumed run starts after its checkpoint's step); one it does not reach is one
line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

import torch

from launcher.errors import UserError

GIB = 2**30


class Window:
    """Steps `first` .. `last`, begun after step `begin_after` (just before `first`, or earlier for a warm-up)."""

    name = "window"

    def __init__(self, first: int, steps: int, warmup: int = 0):
        self.first, self.last, self.warmup = first, first + steps - 1, warmup
        self.begin_after = first - 1 - warmup
        self.on = False

    def clip(self, start: int, total: int, say: Callable[[str], None]) -> bool:
        """Fit the window to this run's steps start+1 .. total; False (said) where none of it is in them."""
        if self.last <= start or self.first > total:
            say(f"{self.name}: steps {self.first}-{self.last} are not among this run's steps {start + 1}-{total}; "
                f"nothing is recorded")
            return False
        self.first, self.last = max(self.first, start + 1), min(self.last, total)
        self.begin_after = max(self.first - 1 - self.warmup, start)
        return True

    def begin(self, done: int) -> None: ...

    def step(self, done: int) -> None: ...

    def end(self, done: int) -> None: ...


class Profile(Window):
    """torch.profiler over the window, with one step of warm-up before it when there is one (the profiler's
    own start-up is not in the steps recorded); each step a `ProfilerStep#<step>` range, as torch names them."""

    name = "profile"

    def __init__(self, cfg, rank: int, device: torch.device, folder: Path, say: Callable[[str], None]):
        super().__init__(cfg.at_step, cfg.steps, warmup=1 if cfg.at_step > 1 else 0)
        self.rank, self.device, self.folder, self.say = rank, device, folder, say
        self.profiler = self.range = None
        self.recording = False

    def begin(self, done: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False)
        self.profiler.prepare_trace()  # a warm-up step runs with the profiler ready but not recording
        self.on = True
        self.step(done)

    def step(self, done: int) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if done >= self.last:
            self.end(done)
            return
        if done + 1 == self.first:
            self.profiler.start_trace()
            self.recording = True
        if self.recording:
            self.range = torch.profiler.record_function(f"ProfilerStep#{done + 1}")
            self.range.__enter__()

    def end(self, done: int) -> None:
        from torch.profiler import tensorboard_trace_handler

        if self.range is not None:  # a step the run did not finish (a signal, an error)
            self.range.__exit__(None, None, None)
            self.range = None
        if not self.recording:  # stopped during the warm-up: nothing recorded to write
            self.profiler.start_trace()
        self.profiler.stop_trace()
        self.on = False
        if not self.recording:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        before = set(self.folder.glob(f"rank{self.rank}.*.pt.trace.json"))
        # torch's own naming (<worker>.<time>.pt.trace.json): TensorBoard's profiler plugin and Perfetto open it
        tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")(self.profiler)
        written = sorted(set(self.folder.glob(f"rank{self.rank}.*.pt.trace.json")) - before)
        self.profiler = None
        self.say(f"profile: steps {self.first}-{min(done, self.last)} of rank {self.rank} in "
                 f"{written[0] if written else self.folder} (Perfetto: ui.perfetto.dev; TensorBoard: the PyTorch "
                 f"profiler plugin)")


class MemorySnapshot(Window):
    name = "memory_snapshot"

    def __init__(self, cfg, rank: int, device: torch.device, folder: Path, say: Callable[[str], None]):
        super().__init__(cfg.at_step, cfg.steps)
        self.rank, self.folder, self.say = rank, folder, say

    def begin(self, done: int) -> None:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.on = True

    def step(self, done: int) -> None:
        if done >= self.last:
            self.end(done)

    def end(self, done: int) -> None:
        path = self.dump(f"rank{self.rank}_step{self.first}-{done}")
        self.say(f"memory_snapshot: steps {self.first}-{done} of rank {self.rank} in {path} "
                 f"(drag it into pytorch.org/memory_viz)")

    def dump(self, name: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{name}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.on = False
        return path


class Watch:
    def __init__(self, windows: List[Window], say: Callable[[str], None] = print):
        self.windows, self.say = windows, say
        self.next: Optional[int] = None  # the step after which anything happens

    def start(self, start: int, total: int) -> None:
        """Before the first step of a run that makes steps start+1 .. total."""
        self.windows = [w for w in self.windows if w.clip(start, total, self.say)]
        self.next = min((w.begin_after for w in self.windows), default=None)
        self.at(start)

    def at(self, done: int) -> None:
        """After step `done` (its logging, evaluation and checkpoint included)."""
        if self.next is None or done < self.next:
            return
        for window in self.windows:
            if window.on:
                window.step(done)
            elif done == window.begin_after:
                window.begin(done)
        # inside a window every step is seen (the profiler marks each); outside, the next window's start
        ahead = [done + 1 if w.on else w.begin_after for w in self.windows if w.on or w.begin_after > done]
        self.next = min(ahead, default=None)

    def close(self, done: int) -> None:
        """The run ends or stops: what an open window recorded is written."""
        for window in self.windows:
            if window.on:
                window.end(done)
        self.next = None

    def out_of_memory(self, step: int, device: torch.device, rank: int) -> str:
        """The line that ends a rank which ran out of memory in `step`."""
        where = f"out of memory in step {step} on {device}"
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            where += f" (peak {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB of {total / GIB:.2f} GiB)"
        else:  # the process's peak resident memory (the allocation that failed is not in it)
            import resource

            where += f" (peak resident {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB)"
        snapshots = [w for w in self.windows if isinstance(w, MemorySnapshot)]
        if snapshots and snapshots[0].on:
            where += f"; memory snapshot: {snapshots[0].dump(f'rank{rank}_out_of_memory_step{step}')}"
        elif snapshots:
            where += f"; memory snapshots: {snapshots[0].folder}"
        return (f"{where}. HINT: lower data.batch_size (or raise trainer.grad_accum_steps for the same global "
                f"batch), precision=bf16, trainer.activation_checkpointing=[...], or strategy=fsdp; the newest "
                f"complete checkpoint is kept and resume: auto continues from it")


def make(recipe, rank: int, world: int, device: torch.device, run_dir: Path, say: Callable[[str], None]) -> Watch:
    windows: List[Window] = []
    profile, memory = recipe.profile, recipe.memory_snapshot
    if profile.at_step is not None:
        beyond = [r for r in profile.ranks if r >= world]
        if beyond:
            raise UserError(f"profile.ranks: {beyond} not below the world size {world}; valid: 0..{world - 1}")
        if rank in profile.ranks:
            windows.append(Profile(profile, rank, device, run_dir / "profile", say))
    if memory.at_step is not None:
        if device.type != "cuda":
            say(f"memory_snapshot: records CUDA's allocator; this run is on {device}, so nothing is recorded")
        else:
            windows.append(MemorySnapshot(memory, rank, device, run_dir / "memory", say))
    return Watch(windows, say)


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's refusal (a RuntimeError of its own wording)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))
