"""Live recovery: the state a live group hands to a group that joins, and how that group takes it.

The state is what a step trains from, taken between two steps: the model's weights, the optimizer's and the
LR schedule's state, the grad scaler's, this process's RNG states and the position (step, epoch, batch; and where
data.train is a stream, the place in it: launcher/data/share.py's joined_place makes it the taker's own). Every
process of a run seeds its RNGs alike, so the giver's RNG states are the taker's too. The taker reads its
batches from the position it takes, its own share of them: after the copy it holds exactly what the live
groups hold, and the two train on bitwise alike.

A sharded strategy's weights and optimizer state are DTensors (fsdp, tp): each travels as this rank's local
shard with its placements, and the taker puts it back on its own mesh, in the place of its own. torchft pairs
rank r of one group with rank r of another, and groups of one recipe hold the same shards at the same rank (the
fingerprint has the layout inside a group), so each rank copies its own shards, and nothing is gathered.

With the state goes the giver's fingerprint (settings.fingerprint): a taker whose recipe differs in a key that
shapes training refuses it, in one line naming the keys, before it loads anything or averages a gradient.

`live` is the loop's view of training (launcher.strategies.base.Live): model (as wrapped), optimizer, schedule,
precision, position. Nothing here is collective: the ranks of a group may give to and take from different
groups.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

import torch
from torch.distributed.tensor import DTensor

from launcher import seeding
from launcher.errors import UserError
from launcher.ft import settings
from launcher.model.plain import unwrap


def boundary(live: Any) -> Dict[str, Any]:
    """What of the state a step's forward moves on (the RNG draws, the position, a stream's place), as it stands at
    the step's start: taken there, and handed over from there whenever torchft asks for it during the step."""
    return {"rng": seeding.capture(device_of(live)), "position": dict(vars(live.position)),
            "stream": live.data.state() if _streaming(live) else None}


def given(live: Any, fingerprint: Mapping[str, Any], at: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """What this process hands over, by reference, with `at` (`boundary`, taken at the step's start; now where not
    given). The weights, optimizer, schedule and scaler are read while the giver is in its step, which changes none
    of them before the taker has its copy: the giver steps only after a quorum the taker is in too."""
    return {"fingerprint": dict(fingerprint),
            "model": _each(unwrap(live.model).state_dict(), lambda key, value: _local(value)),
            "optimizer": _tree(live.optimizer.state_dict(), _local),
            "schedule": live.schedule.state_dict() if live.schedule is not None else None,
            "scaler": live.precision.state_dict(),
            **dict(at if at is not None else boundary(live))}


def take(state: Mapping[str, Any], live: Any, fingerprint: Mapping[str, Any]) -> None:
    """Put a live group's state in place of this process's, once its fingerprint is this recipe's."""
    refused = settings.refused(fingerprint, state.get("fingerprint", {}))
    if refused:
        raise UserError(refused)
    model = unwrap(live.model)
    own = model.state_dict()
    with torch.no_grad():
        model.load_state_dict(_each(state["model"], lambda key, value: _placed(value, own.get(key))), strict=True)
    live.optimizer.load_state_dict(_optimizer_placed(state["optimizer"], live.optimizer))
    if live.schedule is not None:
        live.schedule.load_state_dict(state["schedule"])
    live.precision.load_state_dict(state["scaler"])
    seeding.restore(state["rng"], device_of(live))
    vars(live.position).update(state["position"])
    if _streaming(live):  # the giver's place in the stream, as this rank's (data/share.py: joined_place)
        live.data.take(state["stream"])


def _streaming(live: Any) -> bool:
    return bool(getattr(live.data, "is_stream", False))


def device_of(live: Any) -> torch.device:
    return next(unwrap(live.model).parameters()).device


SHARD = "local shard"  # a DTensor as it travels: {SHARD: its local tensor, "placements", "shape", "stride"}


def _each(state_dict: Dict[str, Any], value: Callable[[str, Any], Any]) -> Dict[str, Any]:
    """A model's state_dict with each of its values replaced, in place (it keeps its modules' _metadata)."""
    for key, old in state_dict.items():
        state_dict[key] = value(key, old)
    return state_dict


def _tree(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """`value` (dicts and lists of tensors and plain values: an optimizer's state) with `leaf` applied to each of
    its leaves."""
    if isinstance(value, dict) and SHARD not in value:  # (a shard that travelled is a leaf)
        return {k: _tree(v, leaf) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_tree(v, leaf) for v in value)
    return leaf(value)


def _local(value: Any) -> Any:
    """A DTensor as this rank's shard (a view of it: given by reference), with where it lies in the whole."""
    if isinstance(value, DTensor):  # its mesh is not sent: the taker's own, from the tensor the shard replaces
        return {SHARD: value.to_local(), "placements": tuple(value.placements), "shape": tuple(value.shape),
                "stride": tuple(value.stride())}
    return value


def _placed(value: Any, like: Any) -> Any:
    """A shard that travelled (`_local`) as a DTensor again, on the mesh of `like` (the taker's own tensor or
    parameter at that place); anything else as it came."""
    if not (isinstance(value, dict) and SHARD in value):
        return value
    if not isinstance(like, DTensor):
        raise ValueError("a live group's sharded state has no sharded counterpart here; the fingerprint has the "
                         "layout, so the two groups cannot differ in it")
    return DTensor.from_local(value[SHARD].to(like.device), like.device_mesh, value["placements"], run_check=False,
                              shape=torch.Size(value["shape"]), stride=value["stride"])


def _optimizer_placed(state: Dict[str, Any], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state with its shards placed like the parameters they belong to (the state's keys are the
    parameters' indices, in the order of the optimizer's groups)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {**state, "state": {i: _tree(kept, lambda v, p=params[i]: _placed(v, p))
                               for i, kept in state["state"].items()}}
