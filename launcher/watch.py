"""Recording windows the recipe asks for: a torch.profiler trace (`profile:`) and CUDA's allocator
history (`memory_snapshot:`), each over a few steps, into the run folder; and the out-of-memory report.

The loop calls `Watch.at(step)` once before its first step and after each step (`step` is the last
step done). Outside a window that is one integer comparison: nothing else runs and nothing is recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

import torch

from launcher.errors import UserError

GIB = 2**30


class Window:
    """Steps `first` .. `last`, begun after step `begin_after` (just before `first`, or earlier for a warm-up)."""

    def __init__(self, first: int, steps: int, warmup: int = 0):
        self.first, self.last = first, first + steps - 1
        self.begin_after = first - 1 - warmup
        self.on = False

    def due(self, done: int) -> Optional[str]:
        if not self.on and done == self.begin_after:
            return "begin"
        if self.on and done >= self.last:
            return "end"
        return "step" if self.on else None


class Profile(Window):
    """torch.profiler over the window, with one step of warm-up before it when there is one (the profiler's
    own start-up is not in the steps recorded); each step a ProfilerStep#N range."""

    def __init__(self, cfg, rank: int, device: torch.device, folder: Path, say: Callable[[str], None]):
        super().__init__(cfg.at_step, cfg.steps, warmup=1 if cfg.at_step > 1 else 0)
        self.rank, self.device, self.folder, self.say = rank, device, folder, say
        self.profiler = None
        self.written: List[Path] = []

    def begin(self) -> None:
        import warnings

        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        warmup = self.first - 1 - self.begin_after
        with warnings.catch_warnings():  # at step 1 there is no step before it to warm up on
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False,
                                    schedule=schedule(wait=0, warmup=warmup, active=self.last - self.first + 1,
                                                      repeat=1), on_trace_ready=self._write)
        self.profiler.start()
        self.on = True

    def step(self) -> None:
        self.profiler.step()

    def _write(self, profiler) -> None:
        from torch.profiler import tensorboard_trace_handler

        self.folder.mkdir(parents=True, exist_ok=True)
        before = set(self.folder.glob(f"rank{self.rank}.*.pt.trace.json"))
        # torch's own naming (<worker>.<time>.pt.trace.json): TensorBoard's profiler plugin and Perfetto open it
        tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")(profiler)
        self.written = sorted(set(self.folder.glob(f"rank{self.rank}.*.pt.trace.json")) - before)

    def end(self, done: int) -> None:
        self.profiler.stop()  # a window cut short by the run's end is written here
        self.on, self.profiler = False, None
        where = self.written[0] if self.written else self.folder
        self.say(f"profile: steps {self.first}-{min(done, self.last)} of rank {self.rank} in {where} "
                 f"(Perfetto: ui.perfetto.dev; TensorBoard: the PyTorch profiler plugin)")


class MemorySnapshot(Window):
    def __init__(self, cfg, rank: int, device: torch.device, folder: Path, say: Callable[[str], None]):
        super().__init__(cfg.at_step, cfg.steps)
        self.rank, self.folder, self.say = rank, folder, say

    def begin(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.on = True

    def step(self) -> None: ...

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
    def __init__(self, windows: List[Window]):
        self.windows = windows
        self.next = min((w.begin_after for w in windows), default=None)  # the step after which anything happens

    def at(self, done: int) -> None:
        """After step `done` (0 before the first)."""
        if self.next is None or done < self.next:
            return
        for window in self.windows:
            action = window.due(done)
            if action == "begin":
                window.begin()
            elif action == "step":
                window.step()
            elif action == "end":
                window.step()
                window.end(done)
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
    return Watch(windows)


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's refusal (a RuntimeError of its own wording)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))
