"""Every `_target_` of a recipe checked before anything is built: it imports, it is callable, and it
accepts the keyword arguments the recipe gives it."""

from __future__ import annotations

from typing import Any, List

from launcher.recipe.instantiate import ArgumentError, MissingArguments, TargetError, check_arguments
from launcher.recipe.schema import TARGETS, Recipe

# How many positional arguments the launcher passes to each target it builds.
_POSITIONAL = {"optimizer": 1, "lr_schedule": 1}
_CALLED = ("loss", "step", "data.collate")  # with metrics.*: what they build, the launcher calls on batches

def check(recipe: Recipe, where) -> List[tuple]:
    """Every `_target_` imports, is callable, and accepts its keyword arguments (a `_partial_` one: those
    it is given, the launcher passing the rest when it calls it): (key, problem) of each that does not."""
    specs = [(k, getattr(recipe, k)) for k in TARGETS]
    specs += [("data.train", recipe.data.train), ("data.val", recipe.data.val), ("data.collate", recipe.data.collate)]
    specs += [(f"metrics.{name}", spec) for name, spec in recipe.metrics.items()]
    problems = []
    for key, spec in specs:
        for sub_key, sub in _targets_in(spec, key):
            target = f"{sub_key}._target_"
            try:
                check_arguments(sub, _POSITIONAL.get(sub_key, 0))
            except ArgumentError as e:  # named where that argument was set: a line of the file, an override
                argument = f"{sub_key}.{e.argument}"
                problems.append((sub_key, f"{where(argument)}: {argument}: {e}"))
            except MissingArguments as e:
                # A plain function named where the launcher calls a callable: it wants the call's arguments.
                hint = "; add _partial_: true to have the launcher call it with them" if _called(sub_key) else ""
                problems.append((sub_key, f"{where(target)}: {target}: {e}{hint}"))
            except TargetError as e:
                problems.append((sub_key, f"{where(target)}: {target}: {e}"))
    return problems


def _called(key: str) -> bool:
    return key in _CALLED or (key.startswith("metrics.") and key.count(".") == 1)


def _targets_in(spec: Any, key: str):
    if isinstance(spec, dict):
        if "_target_" in spec:
            yield key, spec
        for k, v in spec.items():
            if k != "_target_":
                yield from _targets_in(v, f"{key}.{k}")
    elif isinstance(spec, list):
        for i, v in enumerate(spec):
            yield from _targets_in(v, f"{key}.{i}")
