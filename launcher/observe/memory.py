"""Every run checks the memory planner: the peak a rank held, measured, beside the figure
`python -m launcher.plan` gives for the run's own layout, in the console and in metrics.jsonl
(`memory/peak_bytes`, `memory/predicted_peak_bytes`).

Measured: on CUDA, the caching allocator's peak over the run (`torch.cuda.max_memory_allocated`); on the
CPU, where no allocator keeps one, torch's memory tracker (`torch.distributed._tools`, FSDP's own under
fsdp) over one step: the run's second (the first makes the optimizer's state), or its first when it resumes
or makes one step. The tracker sees what Python's dispatcher allocates: DDP's buckets, allocated by its C++
reducer, are added as their size (`buckets`), as the planner adds them.

Planned: rank 0 starts the planner for its run's layout beside training at its first log step (not while
the run starts), on the CPU only when no other process wants it (SCHED_IDLE); its figure is said at the first
log step after it is ready, and, with `logging.memory_plan: wait`, waited for at the end. It is advisory: its
result is read from a file of its own, and nothing it prints, writes or fails at fails the run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, List, Optional

import torch

from launcher.observe.watch import Window

MIB = 2**20
ENV_LEFT_OUT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_NTASKS")


class Measured(Window):
    """The peak of one step on the CPU (a tracker around it), or of the whole run on CUDA."""

    name = "memory peak"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 sharded: bool, buckets: int = 0):
        super().__init__(2, 1)
        # DDP builds its buckets anew in the forward of its second step (in the order the gradients came):
        # that step allocates them where the tracker sees them. The step after it is measured.
        self.after = 3 if buckets else 2
        self.model, self.optimizer, self.device, self.sharded, self.buckets = model, optimizer, device, sharded, buckets
        self.tracker = None
        self.bytes: Optional[int] = None
        self.step_measured: Optional[int] = None
        self.length: Optional[int] = None  # the measured step's longest micro-batch, padded (what the plan plans)
        self.routed = [0, 0]  # under ep: the (token, expert) pairs the measured step sent, and received

    def route(self, sent: int, received: int) -> None:
        """An expert-parallel dispatch's pairs (the measured step's are kept: the planner plans that routing)."""
        if self.on:
            self.routed[0] += sent
            self.routed[1] += received

    def capacity(self) -> Optional[float]:
        """Under ep: the pairs this rank's experts received in the measured step over an even share (its own)."""
        return self.routed[1] / self.routed[0] if self.routed[0] else None

    def saw(self, batch) -> None:
        """A micro-batch of the step (the measured step's are kept: the planner plans one as long)."""
        if self.on and self.device.type != "cuda":
            found = padded_length(batch)
            if found is not None:
                self.length = max(self.length or 0, found)

    def clip(self, start: int, total: int, say: Callable[[str], None]) -> bool:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return False  # nothing to do between steps: the allocator keeps the peak
        if total <= start:
            return False
        self.first = self.last = min(start + self.after, total) if start == 0 else start + 1
        self.begin_after = self.first - 1
        return True

    def begin(self, done: int) -> None:
        self.tracker = tracker(self.model, self.optimizer, self.sharded)
        self.tracker.__enter__()
        self.on = True

    def step(self, done: int) -> None:
        if done >= self.last:
            self.end(done)

    def end(self, done: int) -> None:
        self.tracker.__exit__(None, None, None)
        self.on = False
        peak = next(iter(self.tracker.get_tracker_snapshot("peak").values()), {})
        self.bytes = int(peak.get("Total", 0)) + self.buckets
        self.step_measured = done
        self.tracker = None

    def peak(self) -> Optional[int]:
        if self.on:  # the last step is the one measured: its end is now (its logging is what asks)
            self.end(self.last)
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.bytes

    def how(self) -> str:
        if self.device.type == "cuda":
            return "CUDA's allocator, the whole run"
        return f"torch's memory tracker, step {self.step_measured}" + (" and DDP's buckets" if self.buckets else "")


def padded_length(batch) -> Optional[int]:
    """A batch's length: the longest second dimension of its tensors of two or more (padded rows' length); None
    where it holds none."""
    from torch.utils._pytree import tree_flatten

    found = [t.shape[1] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() >= 2]
    return max(found) if found else None


def tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool, *tensors: torch.Tensor):
    """torch's memory tracker for a step of `model` (FSDP's own when sharded), counting what the step allocates:
    not the memory of a view of a tensor made before (a dataset's item sliced out of its whole text, say), which
    torch's tracker would count as new when the step first touches it."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.common_utils import get_untyped_storages

    class NewOnly:
        def _track(self, reftype, t: torch.Tensor) -> None:
            # An op's new tensor spans its whole storage; one that does not, whose storage the tracker has not
            # seen, is an alias of memory from before the window (dispatch shows views as plain tensors)
            part = t.storage_offset() != 0 or t.numel() * t.element_size() < t.untyped_storage().nbytes()
            if part and all(self._WINFO.get(st) is None for st in get_untyped_storages(t)):
                return
            super()._track(reftype, t)

        running = 0  # the peak while a module runs forward or backward (the model's step, less the optimizer's)
        forward: dict = {}  # the figures at the peak of forward
        backward: dict = {}  # the figures at the peak of backward
        outside: dict = {}  # the figures at the peak outside both (the optimizer's step)

        def _update_peak_stats(self, peak_state) -> None:
            # torch's own walks every module's figures at every operation (the time grows with the square of a
            # model's depth): only the peak, and the peak inside the model, are kept
            for dev, snap in self._curr_mem_snap.items():
                total = snap["Total"]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)
                inside = len(self._mod_tracker.parents) > 1
                if total > self.running and inside:
                    self.running = total
                phase = "backward" if self._mod_tracker.is_bw else "forward" if inside else "outside"
                if total > getattr(self, phase).get("Total", 0):
                    setattr(self, phase, dict(snap))

        def _pre_fw_hook(self, module, inputs) -> None:
            # the model's forward again in the window (accumulation's next micro-batch, an evaluation): torch's
            # tracker wants its modules' own figures cleared first (the peak so far stays)
            again = module in self.memory_tracking and not self._mod_tracker.is_bw
            if again and set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # a frozen parameter (a LoRA model's base) gets no gradient, nor a hook (torch refuses one)
            for q in module.parameters():
                if not q.requires_grad and self._param_to_grad_hook_handles.get(q) is None:
                    self._param_to_grad_hook_handles[q] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    class Sharded(NewOnly, FSDPMemTracker):
        def __enter__(self):
            # FSDP's tracker refuses its root's forward again as its own hook, which runs before the module
            # trackers' hooks: this one, put first, clears the modules' figures before it
            def again(module, args) -> None:
                if module in self.memory_tracking and not self._mod_tracker.is_bw:
                    self.reset_mod_stats()

            entered = super().__enter__()  # (which puts FSDP's hooks first again)
            self.again = model.register_forward_pre_hook(again, prepend=True)
            return entered

        def __exit__(self, *args) -> None:
            self.again.remove()
            super().__exit__(*args)

    if sharded:
        found = Sharded(model, optimizer)
        found.track_inputs(tensors)
    else:
        found = type("StepTracker", (NewOnly, MemTracker), {})()
        found.track_external(model, optimizer, *tensors)
    return found


def _child() -> None:
    """In the planner's process before it starts: the CPU only when no other process wants it (SCHED_IDLE,
    where there is one; else the lowest priority), and an end with its run's process (Linux: killed when the
    parent dies, by SIGKILL too), so that a killed run leaves nothing behind."""
    os.nice(19)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        pass
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the run still kills it at its end
        pass


class _NoHook:
    def remove(self) -> None:
        pass


def ddp_buckets(model: torch.nn.Module, as_view: bool) -> int:
    """The bytes of DDP's all-reduce buckets that no tracker sees: a copy of every trainable parameter's
    gradient, unless the gradients are views into them (then counted as the gradients)."""
    if as_view:
        return 0
    return sum(q.numel() * q.element_size() for q in model.parameters() if q.requires_grad)


class Planned:
    """`python -m launcher.plan --as-run` for this run's layout, in a process of its own beside training, started
    when asked (`start`: the run starts it after its first steps). It is advisory: its result comes from the
    file it is given (`--out`, written whole by a rename; the recipe's code may print anything on its stdout),
    and whatever it does or writes, `result` says a line and never raises."""

    def __init__(self, recipe_path: Path, overrides: List[str], strategy: str, world: int, device_type: str):
        self.folder = tempfile.TemporaryDirectory(prefix="launcher-plan-")
        self.out = Path(self.folder.name) / "plan.json"
        self.err = Path(self.folder.name) / "plan.err"
        # the planner's arguments: run with the file it writes to, and said as the command that shows its failure
        self.args = [str(recipe_path), *overrides, "--as-run", strategy, "--devices", str(world), "--device", device_type]
        self.command = shlex.join(["python", "-m", "launcher.plan", *self.args])
        # the command a reader types to size devices for this recipe (said beside a peak measured without a plan)
        self.sizing = shlex.join(["python", "-m", "launcher.plan", str(recipe_path), *overrides]) + \
            " --devices N --memory 80GB"
        self.argv = [sys.executable, "-m", "launcher.plan", *self.args, "--out", str(self.out)]
        self.process: Optional[subprocess.Popen] = None
        self.failed: Optional[str] = None  # why it could not start
        self.said = False
        self.assumes: Optional[str] = None  # what the plan assumed that the run's values decide (ep's routing)
        self.given = False  # the measured step's batch and routing (as_measured)

    def as_measured(self, length: Optional[int], capacity: Optional[float] = None) -> None:
        """Plan a micro-batch as long as the one the run measured (padded to `length`), not the longest the data
        may give, and under ep the routing it had (`capacity`: its pairs received over an even share), not an even
        one: the run's figure is of its measured step (before `start`; None: the planner's default)."""
        if self.process is not None or self.given:
            return
        self.given = True
        given = (["--length", str(length)] if length is not None else []) + \
                (["--ep-capacity", f"{capacity:.4g}"] if capacity is not None else [])
        self.args += given
        self.command = shlex.join(["python", "-m", "launcher.plan", *self.args])
        self.argv[-2:-2] = given  # before its --out FILE

    def start(self) -> None:
        if self.process is not None or self.failed:
            return
        env = {k: v for k, v in os.environ.items() if k not in ENV_LEFT_OUT}
        try:
            with open(self.err, "w") as err:
                self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=err,
                                                stdin=subprocess.DEVNULL, env=env, preexec_fn=_child)
        except Exception as e:  # noqa: BLE001 - advisory: a planner that cannot start is a line, not the run's end
            self.failed = f"memory: not planned: the planner could not start ({type(e).__name__}: {e})"

    def ready(self) -> bool:
        return bool(self.failed) or self.process is not None and self.process.poll() is not None

    def result(self, wait: bool) -> tuple:
        """(the planned peak in bytes or None, the line that says it or why there is none; None: not ready)."""
        if not wait and not self.ready():
            return None, None
        try:
            return self._read()
        except Exception as e:  # noqa: BLE001 - advisory: nothing it does fails the run
            return None, f"memory: not planned: its result could not be read ({type(e).__name__})"

    def _read(self) -> tuple:
        self.start()
        if self.failed:
            return None, self.failed
        try:
            code = self.process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return None, "memory: not planned: the planner took more than 10 minutes"
        row = json.loads(self.out.read_text().splitlines()[0]) if self.out.is_file() else None
        if not isinstance(row, dict):
            lines = [x for x in self.err.read_text(errors="replace").splitlines() if x.strip()]
            why = lines[-1].removeprefix("launcher: ") if lines else f"exit code {code}"
            return None, f"memory: not planned: the planner failed ({why[:200]}; {self.command} shows it)"
        figure = row.get("peak_bytes")
        if not isinstance(figure, int):
            return None, f"memory: not planned: {row.get('problem') or 'its result holds no figure'}"
        self.assumes = row.get("assumes") if isinstance(row.get("assumes"), str) else None
        return figure, (f"memory: {figure / MIB:.1f} MiB per rank at the peak of a step, planned for "
                        f"{row.get('layout')} (python -m launcher.plan{self.assuming()})")

    def assuming(self) -> str:
        """The plan's assumption, as the lines that give its figure say it after the planner's name."""
        return f", assuming {self.assumes}" if self.assumes else ""

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.folder.cleanup()
