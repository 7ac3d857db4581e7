"""Live recovery: the state a live group hands to a group that joins, and how that group takes it.

The state is what a step trains from, taken between two steps: the model's weights, the optimizer's and the
LR schedule's state, the grad scaler's, this process's RNG states and the position (step, epoch, batch). Every
process of a run seeds its RNGs alike, so the giver's RNG states are the taker's too. The taker reads its
batches from the position it takes, its own share of them: after the copy it holds exactly what the live
groups hold, and the two train on bitwise alike.

With the state goes the giver's fingerprint (settings.fingerprint): a taker whose recipe differs in a key that
shapes training refuses it, in one line naming the keys, before it loads anything or averages a gradient.

`live` is the loop's view of training (launcher.strategies.base.Live): model (as wrapped), optimizer, schedule,
precision, position. Nothing here is collective: the ranks of a group may give to and take from different
groups (torchft pairs rank r of one group with rank r of another).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from launcher import seeding
from launcher.errors import UserError
from launcher.ft import settings
from launcher.model.plain import unwrap


def given(live: Any, fingerprint: Mapping[str, Any]) -> Dict[str, Any]:
    """What this process hands over, by reference (the weights are read while the giver waits in its step,
    which changes none of them before the taker has its copy: torchft holds the optimizer step until then)."""
    return {"fingerprint": dict(fingerprint),
            "model": unwrap(live.model).state_dict(),
            "optimizer": live.optimizer.state_dict(),
            "schedule": live.schedule.state_dict() if live.schedule is not None else None,
            "scaler": live.precision.state_dict(),
            "rng": seeding.capture(device_of(live)),
            "position": dict(vars(live.position))}


def take(state: Mapping[str, Any], live: Any, fingerprint: Mapping[str, Any]) -> None:
    """Put a live group's state in place of this process's, once its fingerprint is this recipe's."""
    theirs = state.get("fingerprint", {})
    if dict(theirs) != dict(fingerprint):
        changed = settings.differences(fingerprint, theirs)
        raise UserError(f"fault_tolerance: this group's recipe differs from the live groups' in "
                        f"{'; '.join(changed[:4])}{' and more' if len(changed) > 4 else ''}; a group joins only a "
                        f"run of the same recipe, and this one was not averaged in")
    with torch.no_grad():
        unwrap(live.model).load_state_dict(state["model"], strict=True)
    live.optimizer.load_state_dict(state["optimizer"])
    if live.schedule is not None:
        live.schedule.load_state_dict(state["schedule"])
    live.precision.load_state_dict(state["scaler"])
    seeding.restore(state["rng"], device_of(live))
    vars(live.position).update(state["position"])


def device_of(live: Any) -> torch.device:
    return next(unwrap(live.model).parameters()).device
