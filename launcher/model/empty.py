"""A model built without its parameters' memory: each parameter is created on the meta device (a shape and
a dtype, no storage), buffers as the model makes them (rotary frequencies, position ids: small, and not
always in a checkpoint). Under fsdp the shards are allocated afterwards (`materialise`), each rank its
own, and filled from the pretrained weights; no rank holds the whole model.

A parameter is moved to meta as its module registers it, so an initialisation in the constructor runs on
meta (no time, no memory, and no random numbers drawn) and a weight tied by assigning the same Parameter
to two modules stays one Parameter."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from launcher.model.plain import tied_names


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers lives on the meta device."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)  # attributes some models mark their parameters with
            module._parameters[name] = moved

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def is_empty(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) parameters on `device`, uninitialised, keeping the buffers' values (torch's
    to_empty allocates buffers afresh too) and ties (one Parameter stays one)."""
    kept = {name: buffer.detach().to(device, copy=True) for name, buffer in model.named_buffers()
            if buffer.device.type != "meta"}
    ties = tied_names(model)
    model.to_empty(device=device)  # a plain meta tensor becomes a new Parameter in each module that holds it
    for tied in ties:
        first = model.get_parameter(tied[0])
        for name in tied[1:]:
            holder, _, attr = name.rpartition(".")
            model.get_submodule(holder)._parameters[attr] = first
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in kept:
                buffer.copy_(kept[name])
