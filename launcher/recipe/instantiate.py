"""`_target_` instantiation in Hydra's convention: a dotted path to a callable, the other keys its keyword
arguments. With `_partial_: true` the target is not called: it becomes `functools.partial(target, *args,
**kwargs)`, for a function (a loss, metric, step or collate) that the launcher calls later with the rest."""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import re
from typing import Any, Callable

META = ("_target_", "_partial_")  # keys that say how to build, never passed to the target


class TargetError(Exception):
    """A `_target_` that does not import, is not callable, or does not accept its arguments."""


# Modules of the launcher that moved into folders (CHANGELOG.md, 0.2): a recipe naming a callable by its old
# path (launcher.collate.Pad) still gets it, from the new one.
MOVED = {"data": "data.sampling", "stream": "data.stream", "loaders": "data.loaders", "collate": "data.collate",
         "item_rng": "data.item_rng", "train": "run.train", "assemble": "run.assemble", "build": "run.build",
         "loop": "run.loop", "first_batch": "run.first_batch", "metrics": "run.metrics", "step": "model.step",
         "precision": "model.precision", "recompute": "model.recompute", "empty": "model.empty",
         "modules": "model.modules", "plain": "model.plain", "watch": "observe.watch", "hang": "observe.hang",
         "throughput": "observe.throughput", "holdings": "observe.holdings", "scheduler": "placement.scheduler",
         "spawn": "placement.spawn"}


def locate(path: str) -> Callable[..., Any]:
    """Import `a.b.C` (or `a.b.C.method`) and return it. Raises TargetError if the path does not name a callable."""
    try:
        return _locate(path)
    except TargetError:
        parts = path.split(".") if isinstance(path, str) else []
        if len(parts) < 3 or parts[0] != "launcher" or parts[1] not in MOVED:
            raise
        return _locate(".".join(["launcher", MOVED[parts[1]], *parts[2:]]))  # the old path of a moved module


def _locate(path: str) -> Callable[..., Any]:
    if not isinstance(path, str):
        raise TargetError(f"_target_ must be a dotted Python path such as torch.nn.CrossEntropyLoss, got {path!r}")
    parts = path.split(".")
    if not path or not all(p.isidentifier() for p in parts):
        raise TargetError(f"'{path}' is not a dotted Python path such as torch.nn.CrossEntropyLoss")
    obj, found = None, 0
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only the path's own module missing is the recipe's mistake; a module that
            # imports something missing is a bug in that module and keeps its traceback.
            if e.name is None or not module_name.startswith(e.name):
                raise
            continue
        found = i
        break
    if obj is None:
        raise TargetError(f"cannot import '{path}': no module named '{parts[0]}'")
    for j in range(found, len(parts)):
        if not hasattr(obj, parts[j]):
            where = ".".join(parts[:j])
            raise TargetError(f"cannot import '{path}': '{where}' has no attribute '{parts[j]}'")
        obj = getattr(obj, parts[j])
    if not callable(obj):
        raise TargetError(f"'{path}' is not callable")
    return obj


class ArgumentError(TargetError):
    """A problem of one keyword argument (`argument`: its name), reported where the recipe sets it."""

    def __init__(self, message: str, argument: str):
        super().__init__(message)
        self.argument = argument


class UnexpectedArgument(ArgumentError):
    """A keyword argument the target has no parameter for."""


class WrongValue(ArgumentError):
    """A keyword argument the target takes, given a value of another kind."""


class MissingArguments(TargetError):
    """The target would accept its arguments, but needs more than the recipe and the launcher give it."""


def is_partial(spec: dict) -> bool:
    """`spec`'s `_partial_` flag. Raises TargetError unless it is true, false or absent."""
    flag = spec.get("_partial_", False)
    if not isinstance(flag, bool):
        raise TargetError(f"_partial_ must be true or false, got {flag!r}")
    return flag


def check_arguments(spec: dict, n_positional: int = 0) -> None:
    """Raise TargetError if the target would not accept `spec`'s keyword arguments (plus n positional ones).
    A partial spec may leave required parameters to its caller: only what it gives is checked."""
    fn = locate(spec["_target_"])
    partial = is_partial(spec)
    try:
        signature = inspect.signature(fn)
        # A wrapper (functools.wraps) shows its wrapped function's signature but may take more: HF configs
        # take every PretrainedConfig key (num_labels, decoder_start_token_id) through such a wrapper's
        # **kwargs. Where the signature cannot prove a refusal, the call decides (see instantiate).
        outer = inspect.signature(fn, follow_wrapped=False)
        if outer != signature and any(p.kind is p.VAR_KEYWORD for p in outer.parameters.values()):
            return
    except (TypeError, ValueError):  # some builtins have no signature: they are checked when called
        return
    args, kwargs = [None] * n_positional, {k: v for k, v in spec.items() if k not in META}
    params = signature.parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for key in kwargs:
            if key not in named:
                close = difflib.get_close_matches(key, named, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise UnexpectedArgument(f"'{spec['_target_']}' takes no argument '{key}'; {hint}its arguments: "
                                         f"{', '.join(named) or 'none'}", key)
    _check_values(spec["_target_"], params, kwargs)
    try:
        signature.bind_partial(*args, **kwargs) if partial else signature.bind(*args, **kwargs)
    except TypeError as e:
        try:
            signature.bind_partial(*args, **kwargs)
        except TypeError:
            raise TargetError(f"'{spec['_target_']}' {e}; its signature is {signature}") from None
        raise MissingArguments(f"'{spec['_target_']}' {e}; its signature is {signature}") from None


def _check_values(target: str, params, kwargs: dict) -> None:
    """A word given where the parameter's default is a number (lr=abc): the call would fail on it, or worse,
    carry it; a parameter whose annotation admits a str is left to the call."""
    for key, value in kwargs.items():
        param = params.get(key)
        if param is None or not isinstance(value, str) or "str" in str(param.annotation) or "Any" in str(param.annotation):
            continue
        default = param.default
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            raise WrongValue(f"'{target}' takes a number for '{key}' (its default: {default!r}), got the string "
                             f"{value!r}", key)


def instantiate(spec: Any, *args: Any, key: str = "") -> Any:
    """Build `spec`: nested mappings with a `_target_` are built first, then the target is called with
    `args` and its keyword arguments, or with `_partial_: true` bound to them in a functools.partial.
    A call that refuses a keyword argument raises UnexpectedArgument naming it (`key`: where spec is)."""
    if isinstance(spec, dict):
        built = {k: instantiate(v, key=f"{key}.{k}".lstrip(".")) for k, v in spec.items() if k not in META}
        if "_target_" not in spec:
            return built
        target = locate(spec["_target_"])
        if is_partial(spec):
            return functools.partial(target, *args, **built)
        try:
            return target(*args, **built)
        except TypeError as e:
            refused = _refused_keyword(e, built)
            if refused is None:
                raise
            close = difflib.get_close_matches(refused, _parameter_names(target), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UnexpectedArgument(f"'{spec['_target_']}' takes no argument '{refused}'{hint}",
                                     f"{key}.{refused}".lstrip(".")) from None
    if isinstance(spec, list):
        return [instantiate(v, key=f"{key}.{i}".lstrip(".")) for i, v in enumerate(spec)]
    return spec


def _refused_keyword(error: TypeError, kwargs: dict):
    """The keyword argument a call's TypeError says it does not take ('got an unexpected keyword
    argument ...'), if it is one the recipe gave."""
    match = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    return match.group(1) if match and match.group(1) in kwargs else None


def _parameter_names(fn: Callable) -> list:
    try:
        return [n for n, p in inspect.signature(fn).parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        return []
