"""A recipe's model trained in float64, for the tests that say "the same weights" (tests/rounding.py says why).

    model._target_=tests.float64.built model.of=<the recipe's model._target_>     (`overrides(target)`)

builds the recipe's model as the recipe would (its initial values those of the float32 run, exactly) and
casts it to float64: parameters, buffers, and the floating inputs it is called with. A model written for
float32 and bf16 may round to float32 on purpose: HF's models do in their RMS norms
(`hidden_states.to(torch.float32)`), their eager attention's softmax (`dtype=torch.float32`), their loss
(`logits.float()`) and DeepSeek-V3's router (`hidden_states.type(torch.float32)`), so that a bf16 model keeps
float32's range there. In a float64 model those casts narrow instead, and put float32's rounding back into every
layout's arithmetic. So while any module of such a model runs forward (or its loss is computed), a cast of a
float64 tensor to float32 leaves it in float64. An MoE model's experts run transformers' loop over the experts
(its default, torch's grouped_mm, has no float64 kernel)."""

from __future__ import annotations

import functools
from typing import Any, List

import torch

_TO, _FLOAT, _TYPE, _SOFTMAX = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type, torch.nn.functional.softmax
_depth = 0  # modules of float64 models running forward, nested


def overrides(target: str) -> List[str]:
    """Recipe overrides that build the recipe's model, `target` (its `_target_`), in float64: after the recipe's
    own model keys (its other keys stay the target's arguments)."""
    return ["model._target_=tests.float64.built", f"model.of={target}"]


def built(of: str, **kwargs: Any) -> torch.nn.Module:
    """`of(**kwargs)` in float64 (the module's docstring)."""
    from launcher.recipe.instantiate import locate

    return in_float64(locate(of)(**kwargs))


def in_float64(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, cast to float64 in place, and run in float64 (the module's docstring)."""
    model.double()
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) == "grouped_mm":  # an MoE model's: torch has no float64 kernel
        config._experts_implementation = "eager"  # of grouped_mm; transformers' loop over the experts computes the same
    model.register_forward_pre_hook(_inputs_in_float64, with_kwargs=True)
    if hasattr(model, "loss_function"):  # an HF model: its casts to float32 kept in float64
        for module in model.modules():
            module.register_forward_pre_hook(_enter)
            module.register_forward_hook(_leave, always_call=True)
        model.loss_function = _widened(model.loss_function)  # (a pipeline's last stage calls it on its own)
    return model


def _inputs_in_float64(module, args, kwargs):
    return tuple(_wide(a) for a in args), {k: _wide(v) for k, v in kwargs.items()}


def _wide(value: Any) -> Any:
    return value.double() if torch.is_tensor(value) and value.is_floating_point() else value


def _widened(loss_function):
    @functools.wraps(loss_function)  # its name too: the launcher's step reads it (ForCausalLMLoss shifts labels)
    def loss(*args, **kwargs):
        _enter()
        try:
            return loss_function(*args, **kwargs)
        finally:
            _leave()

    return loss


def _enter(*_: Any) -> None:
    global _depth
    if _depth == 0:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = _to, _float, _type
        torch.nn.functional.softmax = _softmax
    _depth += 1


def _leave(*_: Any) -> None:
    global _depth
    _depth -= 1
    if _depth == 0:
        del torch.Tensor.to, torch.Tensor.float, torch.Tensor.type  # torch's own again (torch.Tensor's base class's)
        torch.nn.functional.softmax = _SOFTMAX


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if self.dtype == torch.float64:
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
    return _TO(self, *args, **kwargs)


def _float(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self if self.dtype == torch.float64 else _FLOAT(self, *args, **kwargs)


def _type(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
    if self.dtype == torch.float64 and dtype is torch.float32:
        return self
    return _TYPE(self, *args, **kwargs) if dtype is None else _TYPE(self, dtype, *args, **kwargs)


def _softmax(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if input.dtype == torch.float64 and kwargs.get("dtype") is torch.float32:
        kwargs["dtype"] = torch.float64
    return _SOFTMAX(input, *args, **kwargs)
