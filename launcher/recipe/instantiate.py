"""`_target_` instantiation in Hydra's convention: a dotted path to a callable, the other keys its keyword arguments."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable


class TargetError(Exception):
    """A `_target_` that does not import, is not callable, or does not accept its arguments."""


def locate(path: str) -> Callable[..., Any]:
    """Import `a.b.C` (or `a.b.C.method`) and return it. Raises TargetError if the path does not name a callable."""
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


def check_arguments(spec: dict, n_positional: int = 0) -> None:
    """Raise TargetError if the target would not accept `spec`'s keyword arguments (plus n positional ones)."""
    fn = locate(spec["_target_"])
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: they are checked when called
        return
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    try:
        signature.bind(*([None] * n_positional), **kwargs)
    except TypeError as e:
        raise TargetError(f"'{spec['_target_']}' {e}; its signature is {signature}") from None


def instantiate(spec: Any, *args: Any) -> Any:
    """Build `spec`: nested mappings with a `_target_` are built first, then the target is called."""
    if isinstance(spec, dict):
        built = {k: instantiate(v) for k, v in spec.items() if k != "_target_"}
        if "_target_" not in spec:
            return built
        return locate(spec["_target_"])(*args, **built)
    if isinstance(spec, list):
        return [instantiate(v) for v in spec]
    return spec
