"""The checkpoints of one run: save() at a step (every rank calls it), resume() once at the start, and
an asynchronous save finished before the next. The strategy knows whether the state is whole on rank 0
or in shards on every rank; the format (formats.py) writes and reads it.

What this file decides is what a failed save does. A save written synchronously to a local folder that
refuses it (a full disk) stops the run with that one line (exit 2), as before training. A save written in
the background, or to an object store (which comes and goes), leaves the newest sealed checkpoint as it
was, says so, and the run trains on: the next save tries again. FAILURES saves failing in a row stop the
run (CheckpointsFailed, exit 7); the final save tries again at once, as often."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from launcher.checkpoint import adapters, files, formats, hf, hf_generation, hf_tokenizer, layout, run_state, storage
from launcher.checkpoint.run_state import RunState
from launcher.checkpoint.staging import Staging
from launcher.errors import CheckpointsFailed, UserError, shown
from launcher.recipe.flat import differences


FAILURES = 3  # saves failing in a row before the run stops (exit 7)


class Checkpoints:
    """The model, the optimizer and the run state of one run, and the checkpoints it writes into
    checkpoint.dir, by default `<run_dir>/checkpoints` (rank 0 writes what is written once; `keep` complete
    ones are kept)."""

    def __init__(self, strategy: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run: RunState,
                 run_dir: Path, section: Any, say: Callable[[str], None] = lambda line: None):
        self.strategy, self.model, self.optimizer, self.run = strategy, model, optimizer, run
        self.run_dir, self.folder = Path(run_dir), layout.folder_of(run_dir, section.dir)
        self.writer = strategy.placement.is_main
        self.keep, self.consolidate, self.export_hf = section.keep, section.consolidate, section.export_hf
        self.async_save, self.say = section.async_save, say
        self.format = formats.written_by(strategy)
        self.saved_step: Optional[int] = None  # the newest checkpoint of this line of training: saved or resumed
        self.pending: Optional[Any] = None  # a save being written in the background: step, began, ready(), seal()
        self.staging = Staging()  # host copies of the state that a background save writes
        self.stager: Optional[Any] = None  # fsdp's on a GPU: DCP's stager into page-locked memory (sharded.py)
        self.failures = 0  # saves failed in a row
        self.waited = False  # a save has waited for the one before it (said once)

    def save(self, final: bool, wait: bool = True) -> None:
        """A checkpoint of the current step (and, when final, model.pt). Every rank calls it. With
        checkpoint.async_save, a save that neither is final nor must `wait` (a signal's) is staged in host
        memory and written in the background; the next save, the end and a signal wait for it."""
        self.finish_pending()
        step = self.run.position.step
        background = self.async_save and not (final or wait)
        while True:
            try:
                self.format.save(self, step, final, background)
            except UserError as e:
                if not (background or storage.is_remote(self.folder)):
                    raise  # a local disk that refuses a synchronous save: one line, exit 2
                if self.failed(step, e, final) and not final:
                    break  # its manifest landed: sealed, though a request after it failed
                if final:
                    continue  # the run's end: at once, until FAILURES in a row
            else:
                if not background:
                    self.sealed(step)
            break
        # Kept after the last agreement (a gather): without it, runs under torchrun (gloo, torch 2.13)
        # now and then aborted at exit after their last save ("terminate called without an active exception").
        self.strategy.barrier()

    def sealed(self, step: int) -> None:
        if self.failures:
            self.say(f"checkpoint step {step} saved: {self.folder / f'step_{step}'}")
        self.saved_step, self.failures = step, 0

    def failed(self, step: int, e: UserError, final: bool = False) -> bool:
        """A save that failed (on every rank: its failure is agreed): said, or the run stopped. What the lines
        say is what the folder holds, read again now: a save whose manifest landed before a later request failed
        (its answer lost, the retention, the export after it) is sealed, and the same command resumes from it.
        Returns whether the checkpoint of `step` is sealed (a save that is not the final one is then done)."""
        problem = "; ".join(e.problems)
        held = self.held()
        if held is not None:
            self.saved_step = held if held >= 0 else None
        path = self.folder / f"step_{step}"
        if held == step and not final:
            self.failures = 0
            self.say(f"checkpoint step {step} saved: {path} (its manifest is in; a request after it failed: {problem})")
            return True
        self.failures += 1
        newest = "none" if self.saved_step is None else f"{self.folder / f'step_{self.saved_step}'} (step {self.saved_step})"
        if held is None:
            newest += (f" as this run last knew it (the store cannot be read now to tell whether step {step}'s manifest "
                       f"landed before the failure)")
        if self.failures >= FAILURES:
            then = (f"The newest sealed checkpoint: {newest}; the same command resumes from "
                    f"{'it' if held is not None else 'the newest sealed one'}" if self.saved_step is not None or held is None
                    else "No checkpoint is sealed: the same command starts over")
            raise CheckpointsFailed(f"checkpoint: {FAILURES} saves in a row failed, the last at step {step} ({problem}); "
                                    f"the run stops. {then}") from None
        what = (f"checkpoint step {step} is sealed ({path}) but what follows its manifest failed ({problem})" if held == step
                else f"checkpoint step {step} was not saved ({problem}); the newest sealed checkpoint: {newest}")
        self.say(f"{what}. Training goes on and the next save tries again ({self.failures} of {FAILURES} failed in a "
                 f"row stop the run)")
        return held == step

    def held(self) -> Optional[int]:
        """The newest step whose checkpoint the folder holds sealed, read now by the writer and told every rank (a
        collective): -1 where none is, None where the folder cannot be read (the store still out of reach)."""
        def newest() -> Optional[int]:
            try:
                sealed = layout.complete(self.folder)
            except Exception:  # noqa: BLE001 - the store out of reach, or anything else: the line says it is unknown
                return None  # (an exception here would leave the other ranks waiting in the gather below)
            return layout.step_of(sealed[-1]) if sealed else -1
        return self.strategy.all_gather_object(newest() if self.writer else None)[0]

    def write_model(self, state: Dict[str, torch.Tensor]) -> Path:
        """<run_dir>/model.pt, atomically (rank 0)."""
        path = self.run_dir / "model.pt"
        try:
            files.save(path, state, atomic=True)
            if self.export_hf:  # beside it, the same weights as a folder from_pretrained loads
                self.export_hf_folder(hf.Tensors.of(state))
        except OSError as e:
            raise files.cannot_write(path, e) from None
        return path

    def export_hf_folder(self, tensors: "hf.Tensors") -> None:
        """<run_dir>/hf/, a folder from_pretrained loads, with a peft model's adapters merged in, and the
        tokenizer the run's came from (rank 0; which one was said at start, hf_tokenizer.checked)."""
        config = json.loads((self.run_dir / hf.RUN_CONFIG).read_text())
        if (self.run_dir / adapters.RUN_CONFIG).is_file():
            tensors = adapters.merged(tensors, json.loads((self.run_dir / adapters.RUN_CONFIG).read_text()))
        tokenizer, _ = hf_tokenizer.of_run(self.run_dir)
        try:
            hf.write(self.run_dir / "hf", tensors, config, None, 5 * 10**9, replace=True,
                     beside={**(hf_tokenizer.read(tokenizer) if tokenizer is not None else {}),
                             **hf_generation.kept(self.run_dir)})
        except OSError as e:
            raise files.cannot_write(self.run_dir / "hf", e) from None

    def finish_pending(self, wait: bool = True) -> None:
        """Seal the asynchronous save still being written, once it is written on every rank (without
        `wait`: only if it is already; a collective either way)."""
        pending = self.pending
        if pending is None:
            return
        if not pending.ready():
            if not wait:
                return
            if not self.waited:  # once a run: the blocked time of every save is in the logged values
                self.waited = True
                self.say(f"checkpoint step {pending.step} is still being written ({time.perf_counter() - pending.began:.2f} s "
                         f"so far): step {self.run.position.step} waits for it. HINT: the store is slower than "
                         f"checkpoint.every steps of training (checkpoint/blocked_s logs what each save costs); "
                         f"save less often")
        self.pending = None
        try:
            pending.seal()
        except UserError as e:
            self.failed(pending.step, e)
        else:
            self.sealed(pending.step)

    def resume(self, folder: Path, recipe: Any) -> List[str]:
        """Continue from a checkpoint of any format, written by any strategy at any world size (its CRC-32s
        were checked when rank 0 chose it). The run state is read first, so that a recipe whose optimizer or
        schedule changed is refused before anything is loaded. Returns the lines to say."""
        kind = formats.of(folder)
        kind.read_run_state(self, folder)
        saved = self.run.loaded
        old_recipe = run_state.saved_recipe(saved)
        _refuse_changed_parts(old_recipe, recipe, folder)
        try:
            kind.load(self, folder)
        except UserError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
            raise run_state.does_not_fit(folder, e) from None
        self.run.apply(folder)
        position = self.run.position
        self.saved_step = position.step
        world, now = saved.get("world_size"), self.strategy.placement.world_size
        elsewhere = f"; written by {world} process{'es' * (world > 1)}, resharded to {now}" if world and world != now else ""
        lines = [f"resumed from {folder} (step {position.step}, epoch {position.epoch}){elsewhere}"]
        lines += [self.run.note] if self.run.note else []
        changed = differences(old_recipe, recipe)
        if changed:
            lines.append(f"the recipe differs from the checkpoint's in {', '.join(changed)}; the optimizer and "
                         f"LR schedule continue from their saved state (checkpoint.resume=never starts over)")
        return lines


def _refuse_changed_parts(saved: Dict[str, Any], current: Any, resume: Path) -> None:
    """The saved optimizer and schedule states belong to the classes that wrote them: another
    optimizer, or a schedule added or removed, cannot continue them."""
    changed = []
    for key in ("optimizer", "lr_schedule"):
        old, new = saved.get(key), current[key]
        old = old.get("_target_") if isinstance(old, dict) else old
        new = new["_target_"] if new is not None else None
        if old != new:  # the saved one is the checkpoint's text: shown escaped
            changed.append(f"{key} ({shown(old or 'none', 80)} -> {new or 'none'})")
    if changed:
        raise UserError(f"checkpoint.resume: the recipe changed {' and '.join(changed)} since {resume}, whose saved "
                        f"state cannot continue under it; start over with checkpoint.resume=never (add "
                        f"checkpoint.init_from={resume / 'model.pt'} to keep its weights)")
