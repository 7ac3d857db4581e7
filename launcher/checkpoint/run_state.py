"""The run's state beside the model and optimizer (position, LR schedule, grad scaler, every rank's RNG, a
stream's place, the recipe): what state.pt holds, checked field by field before anything uses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch
import yaml

from launcher import seeding
from launcher.checkpoint import files
from launcher.errors import UserError, first_line, shown

# The run state's fields and what each must be; anything else in state.pt is refused.
FIELDS = {"position": dict, "optimizer": dict, "lr_schedule": (dict, type(None)), "scaler": dict,
          "rng": list, "recipe": str, "world_size": int, "stream": (list, type(None))}
POSITION_FIELDS = ("step", "epoch", "batch")


class RunState:
    """The run's state, as DCP's Stateful protocol has it. state_dict() is collective (it gathers every
    rank's RNG states); load_state_dict() keeps what it reads until apply() puts it back, so that a
    checkpoint can be checked against the recipe first."""

    def __init__(self, position: Any, schedule: Optional[Any], precision: Any, strategy: Any, recipe: str,
                 data: Any = None):
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
                "stream": self.strategy.data_states(self.data.state()) if self._streaming() else None}

    def _streaming(self) -> bool:
        return bool(getattr(self.data, "is_stream", False))

    def state_dict(self) -> Dict[str, Any]:
        # One opaque value for DCP: its fields (a list with one entry per rank) would otherwise become
        # keys that differ with the world size, which a resume at another world size could not find.
        return {"fields": files.to_bytes(self.fields())}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loaded = checked(files.load_bytes(state["fields"]), "the run state")

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
                self.note = self.data.resume(state["stream"], len(state["stream"]))  # one per data-parallel rank
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
            raise does_not_fit(where, e) from None
        vars(self.position).update(state["position"])


def does_not_fit(where: Path, e: BaseException) -> UserError:
    return UserError(f"checkpoint.resume: {where} does not fit this run ({type(e).__name__}: "
                     f"{shown(first_line(e), 160)}); start over with checkpoint.resume=never")


def load(path: Path, map_location: Any = "cpu") -> Dict[str, Any]:
    """A checkpoint's state.pt, checked field by field: a file of another structure is one line, never a
    KeyError or TypeError further on."""
    return checked(files.load(path, map_location), path, optimizer=True)


def checked(state: Any, where: Any, optimizer: bool = False) -> Dict[str, Any]:
    """The run state, once checked field by field (with the optimizer's, as state.pt holds it; a sharded
    checkpoint keeps the optimizer's in its shards)."""
    problem = _problem(state, optimizer)
    if problem:
        raise UserError(f"{where}: not a run state of this launcher: {problem}")
    return state


def _problem(state: Any, optimizer: bool) -> Optional[str]:
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a mapping"
    fields = {k: v for k, v in FIELDS.items() if optimizer or k != "optimizer"}
    missing = [k for k in fields if k not in state and k not in ("world_size", "stream")]
    extra = [k for k in state if k not in fields]
    if missing or extra:
        return f"missing {', '.join(missing)}" if missing else f"unknown field '{shown(extra[0], 80)}'"
    for key, kind in fields.items():
        if key in state and (not isinstance(state[key], kind) or isinstance(state[key], bool)):
            return f"{key} is a {type(state[key]).__name__}"
    position = state["position"]
    if sorted(position) != sorted(POSITION_FIELDS) or not all(
            type(position[k]) is int and position[k] >= 0 for k in POSITION_FIELDS):
        return f"position must hold {', '.join(POSITION_FIELDS)} as counts, got {position!r:.80}"
    if optimizer and (not isinstance(state["optimizer"].get("state"), dict)
                      or not isinstance(state["optimizer"].get("param_groups"), list)):
        return "optimizer is not an optimizer's state_dict (state, param_groups)"
    if not state["rng"] or not all(isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) for r in state["rng"]):
        return "rng must list each rank's generator states"
    return None


def saved_recipe(state: Dict[str, Any]) -> Dict[str, Any]:
    """The recipe a checkpoint was written with, as plain data: YAML read without OmegaConf, so an
    interpolation or resolver in it (`${oc.env:...}`) stays text and is never resolved."""
    try:
        data = yaml.load(state["recipe"], Loader=_NoAliases)
    except (yaml.YAMLError, RecursionError) as e:
        raise UserError(f"the checkpoint's recipe is not YAML: {shown(first_line(e))}") from None
    if not isinstance(data, dict):
        raise UserError("the checkpoint's recipe is not a mapping of keys")
    return data


class _NoAliases(yaml.SafeLoader):
    """Plain YAML without anchors and aliases (a few aliases can expand into billions of nodes)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("aliases (*name) are not allowed in a saved recipe")
        return super().compose_node(parent, index)
