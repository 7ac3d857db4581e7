"""What a checkpoint holds, saved and restored in one place, whichever strategy runs.

The model and optimizer state come from the strategy (full tensors, or each rank's shards), keyed by
the plain model's parameter names; the rest of the run (position, LR schedule, grad scaler, every
rank's RNG, the recipe) is one Stateful object. A full-state strategy's rank 0 writes them as
model.pt and state.pt; a sharded strategy's ranks write them as DCP shards (launcher/sharded.py).
Either kind resumes under any strategy at any world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from launcher import checkpoint, seeding, sharded
from launcher.checkpoint import Checkpointer
from launcher.data import Position
from launcher.errors import UserError, first_line
from launcher.precision import Precision
from launcher.strategies import Strategy


class RunState:
    """The run's state beside the model and optimizer, as DCP's Stateful protocol has it. state_dict()
    is collective (it gathers every rank's RNG states); load_state_dict() keeps what it reads until
    apply() puts it back, so that a checkpoint can be checked against the recipe first."""

    def __init__(self, position: Position, schedule: Optional[Any], precision: Precision, strategy: Strategy,
                 recipe: str, data: Any = None):
        self.position, self.schedule, self.precision, self.strategy, self.recipe = (
            position, schedule, precision, strategy, recipe)
        self.data = data  # a stream's place is kept per rank (TrainData's is the position)
        self.loaded: Optional[Dict[str, Any]] = None
        self.note: Optional[str] = None  # what resuming the data stream said

    def fields(self) -> Dict[str, Any]:
        rngs = self.strategy.all_gather_object(seeding.capture(self.strategy.device))
        return {"position": vars(self.position).copy(),
                "lr_schedule": self.schedule.state_dict() if self.schedule is not None else None,
                "scaler": self.precision.state_dict(), "rng": rngs,
                "world_size": self.strategy.placement.world_size, "recipe": self.recipe,
                "stream": self.strategy.all_gather_object(self.data.state()) if self._streaming() else None}

    def _streaming(self) -> bool:
        return bool(getattr(self.data, "is_stream", False))

    def state_dict(self) -> Dict[str, Any]:
        # One opaque value for DCP: its fields (a list with one entry per rank) would otherwise become
        # keys that differ with the world size, which a resume at another world size could not find.
        return {"fields": checkpoint.to_bytes(self.fields())}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loaded = checkpoint.state_problem_checked(checkpoint.load_bytes(state["fields"]), "the run state")

    def apply(self, where: Path) -> None:
        """Put the loaded state back; a state that does not fit this run is one line, not a traceback."""
        state, rank = self.loaded, self.strategy.placement.rank
        try:
            if self.schedule is not None:
                self.schedule.load_state_dict(state["lr_schedule"])
            self.precision.load_state_dict(state["scaler"])
            rngs = state["rng"]
            seeding.restore(rngs[rank] if rank < len(rngs) else rngs[0], self.strategy.device)
            if self._streaming():
                if not state.get("stream"):
                    raise UserError(f"checkpoint.resume: {where} was written reading map-style data and data.train is "
                                    f"now a stream; start over with checkpoint.resume=never")
                self.note = self.data.resume(state["stream"], state.get("world_size", len(state["stream"])))
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
            raise does_not_fit(where, e) from None
        vars(self.position).update(state["position"])


class _Reading:
    """The run state as DCP's load sees it: a destination for its one value, without gathering RNG states."""

    def __init__(self, run: RunState):
        self.run = run

    def state_dict(self) -> Dict[str, Any]:
        return {"fields": b""}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run.load_state_dict(state)


def does_not_fit(where: Path, e: BaseException) -> UserError:
    return UserError(f"checkpoint.resume: {where} does not fit this run ({type(e).__name__}: "
                     f"{first_line(e)[:160]}); start over with checkpoint.resume=never")


class Training:
    """The model, the optimizer and the run state of one run, with the checkpoints it writes.

    save() and resume() are collective: every rank calls them, and only the strategy knows whether
    the state is whole on rank 0 or in shards on every rank."""

    def __init__(self, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer, run: RunState,
                 checkpointer: Checkpointer, consolidate: str = "final", async_save: bool = False):
        self.strategy, self.model, self.optimizer, self.run = strategy, model, optimizer, run
        self.checkpointer, self.consolidate = checkpointer, consolidate
        self.async_save = async_save and strategy.sharded
        self.saved_step: Optional[int] = None  # the newest checkpoint of this line of training: saved or resumed
        self.pending: Optional[tuple] = None  # (step, folder, future, model.pt's entry) of a save being written

    # ---- resume ----------------------------------------------------------------------------------

    def read_run_state(self, folder: Path) -> Dict[str, Any]:
        """The checkpoint's run state (its recipe, position, ...), read before anything else of it."""
        if sharded.is_sharded(folder):
            sharded.read(folder, {"run": _Reading(self.run)})
        else:
            fields = checkpoint.load_state(folder / "state.pt", map_location=self.strategy.device)
            self.run.loaded = fields
        return self.run.loaded

    def resume(self, folder: Path) -> None:
        """Load the model and optimizer state of a checkpoint of either kind, resharded to this run, and the
        run state read by read_run_state()."""
        try:
            if sharded.is_sharded(folder):
                model_state, optimizer_state = self.strategy.state_dicts(self.model, self.optimizer)
                sharded.read(folder, {"model": model_state, "optimizer": optimizer_state})
                full = False
            else:
                plain = self.strategy.unwrap(self.model)
                model_state, _ = checkpoint.fitting_state(plain.state_dict(), folder / "model.pt",
                                                       map_location=self.strategy.device, verified=True)
                optimizer_state = named_optimizer_state(self.run.loaded.pop("optimizer"), plain, self.optimizer)
                full = True
            self.strategy.load_state_dicts(self.model, self.optimizer, model_state, optimizer_state, full=full)
        except UserError:
            raise
        except sharded.DoesNotFit as e:
            raise UserError(f"checkpoint.resume: {folder} does not fit this run ({e}); start over with "
                            f"checkpoint.resume=never") from None
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError, CheckpointException) as e:
            raise does_not_fit(folder, e) from None
        self.run.apply(folder)
        self.saved_step = self.run.position.step

    # ---- save --------------------------------------------------------------------------------------

    def save(self, final: bool) -> None:
        """A checkpoint of the current step (and, when final, model.pt). Every rank calls it."""
        self.finish_pending()
        step = self.run.position.step
        if self.strategy.sharded:
            self._save_shards(step, final)
        else:
            self._save_full(step, final)
        self.saved_step = step
        # Kept after the last agreement (a gather): without it, about one run in twelve under torchrun
        # (gloo, torch 2.13) aborted at exit after its last save ("terminate called without an active
        # exception"; 4 of 51 runs, 0 of 40 with it).
        self.strategy.barrier()

    def _save_full(self, step: int, final: bool) -> None:
        fields = self.run.fields()  # a collective
        model_state = self.strategy.model_state(self.model)
        _, optimizer_state = self.strategy.state_dicts(self.model, self.optimizer)
        state = {**fields, "optimizer": optimizer_state}

        def write() -> None:
            self.checkpointer.save(step, model_state, state)
            if final:
                self.checkpointer.save_final(model_state)

        self.strategy.agree(write)  # no rank goes on before the checkpoint is complete, or all stop with its mistake

    def _save_shards(self, step: int, final: bool) -> None:
        folder = self.checkpointer.partial(step)
        writer, agree = self.checkpointer.writer, self.strategy.agree
        agree(lambda: self.checkpointer.prepare(folder) if writer else None)
        model_state, optimizer_state = self.strategy.state_dicts(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "run": self.run}
        background = self.async_save and not final
        if background:  # the state is copied to host memory before start() returns
            group = self.strategy.checkpoint_group()
            future = agree(lambda: self.checkpointer.guarded(folder, lambda: sharded.start(folder, state, group)))
        else:
            agree(lambda: self.checkpointer.guarded(folder, lambda: sharded.write(folder, state)))
        # model.pt of this step's weights, gathered now (a collective), before training changes them
        whole = self.consolidate == "every" or (final and self.consolidate == "final")
        full = self.strategy.model_state(self.model) if whole else None
        gathered = agree(lambda: self.checkpointer.guarded(
            folder, lambda: {"model.pt": self.checkpointer.write_model(folder / "model.pt", full)})
            if writer and full is not None else {})
        if background:
            self.pending = (step, folder, future, gathered)
            return
        self._seal(step, folder, gathered, full if final else None)

    def _seal(self, step: int, folder: Path, gathered: Dict[str, Any], final: Optional[Dict[str, torch.Tensor]]) -> None:
        """Once every rank's shards are written: rank 0's manifest (every rank's files) and rename, then the
        final model.pt when given."""
        rank, writer = self.strategy.placement.rank, self.checkpointer.writer
        files = self.strategy.agree(lambda: self.checkpointer.guarded(folder, lambda: sharded.own_files(folder, rank)))
        every: Dict[str, Any] = dict(gathered)
        for theirs in self.strategy.all_gather_object(files):
            every.update(theirs)

        def seal() -> None:
            self.checkpointer.seal(step, folder, every, sharded=True, world_size=self.strategy.placement.world_size)
            if final is not None:
                self.checkpointer.save_final(final)

        self.strategy.agree(lambda: seal() if writer else None)

    def finish_pending(self, wait: bool = True) -> None:
        """Seal the asynchronous save still being written, once it is written on every rank (without
        `wait`: only if it is already; a collective either way)."""
        if self.pending is None:
            return
        step, folder, future, gathered = self.pending
        if not wait and not all(self.strategy.all_gather_object(future.done())):
            return
        self.pending = None
        self.strategy.agree(lambda: self.checkpointer.guarded(folder, future.result))
        self._seal(step, folder, gathered, None)


def named_optimizer_state(state: Dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """An optimizer state_dict keyed by parameter names, as torch's set_state_dict takes it. Checkpoints
    written before the strategies owned their state hold optimizer.state_dict()'s indices instead: the
    i-th parameter of the optimizer's groups is the i-th index."""
    if all(isinstance(k, str) for k in state["state"]) and all(
            isinstance(p, str) for g in state["param_groups"] for p in g["params"]):
        return state
    names = {id(p): n for n, p in model.named_parameters()}
    order: List[str] = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {"state": {order[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
