"""Load a recipe: YAML file + key=value overrides, merged into the schema by OmegaConf.

Every problem is collected and reported at once, each on one line that names the
file (and line) or the override it came from. OmegaConf does the merging, type
conversion and interpolation; launcher/recipe/merge.py walks the input key by key so
one bad value does not hide the next. This module composes the file, its on_cpu keys
and the overrides, then resolves every value and checks the recipe built from them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue, OmegaConfBaseException

from launcher.errors import UserError, first_line, short
from launcher.recipe import merge, targets, yamlfile
from launcher.recipe.schema import Recipe


@dataclass
class Loaded:
    recipe: Recipe
    config: DictConfig  # resolved; `OmegaConf.to_yaml(config)` is what the run folder keeps
    path: Path
    notes: List[str] = dataclasses.field(default_factory=list)  # what loading decided (on_cpu applied)
    overrides: List[str] = dataclasses.field(default_factory=list)  # the command line's key=value, as given


def load(path: str | os.PathLike, overrides: List[str] = ()) -> Loaded:
    """Return the validated recipe, or raise UserError listing every problem."""
    path = Path(path)
    _make_importable(path)
    user, lines = yamlfile.read(path)
    cfg, origin, problems = _compose(path, user, lines, [], overrides)
    notes: List[str] = []
    on_cpu = _on_cpu_keys(cfg) if not problems else []
    if on_cpu:  # the recipe again, with its on_cpu keys between the file and the command line
        cfg, origin, problems = _compose(path, user, lines, on_cpu, overrides)
        notes.append(f"on_cpu: no GPU for this run (devices: {OmegaConf.select(cfg, 'devices')}); the recipe's on_cpu "
                     f"keys apply: {', '.join(k for k, _ in on_cpu)} (key=value on the command line still wins)")

    def where(key: str) -> str:
        # The most specific key that was set by the user names the place to look: the key, the first
        # of its own keys that was set (a mapping an override created), or the closest section.
        inside = [k for k in origin if k.startswith(key + ".")]
        if key not in origin and inside:
            return origin[inside[0]]
        probe = key
        while probe:
            if probe in origin:
                return origin[probe]
            probe = probe.rpartition(".")[0]
        return str(path)

    problems += _resolve_all(cfg, "", where, reported={p.split(": ")[1] for p in problems if ": " in p})
    # A key whose value was refused kept its default, so the recipe still builds: its values and targets
    # are checked too, and every problem is reported at once (not only those of the first kind found).
    recipe = _built(cfg)
    if recipe is not None:
        def fresh(key: str) -> bool:  # a key not reported already (a refused value is not checked again)
            return not any(f" {key}: " in p or f" {key}." in p for p in problems)

        found = [(key, f"{where(key)}: {key}: {msg}") for key, msg in recipe.problems()]
        found += targets.check(recipe, where)  # keyed by their component: one mistake, one line
        for key, problem in found:
            if fresh(key):
                problems.append(problem)
    if problems:
        raise UserError(*problems)
    OmegaConf.resolve(cfg)
    return Loaded(recipe=recipe, config=cfg, path=path, notes=notes, overrides=list(overrides))


def _built(cfg: DictConfig) -> Optional[Recipe]:
    """The Recipe of `cfg`, or None where a value is missing or cannot resolve (reported already)."""
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException:
        return None


def _on_cpu_keys(cfg: DictConfig) -> List[tuple]:
    """The recipe's on_cpu keys as (dotted key, value), when this run will have no GPU; else none."""
    section = OmegaConf.select(cfg, "on_cpu")
    if not section:
        return []
    devices = OmegaConf.select(cfg, "devices")
    if isinstance(devices, str) and devices.startswith("auto"):
        import torch

        gpu = torch.cuda.is_available()
    else:
        gpu = devices != "cpu"
    if gpu:
        return []

    def leaves(value: Any, prefix: str) -> List[tuple]:
        if isinstance(value, dict) and value and "_target_" not in value:
            return [pair for k, v in value.items() for pair in leaves(v, f"{prefix}{k}.")]
        return [(prefix[:-1], value)]

    return leaves(OmegaConf.to_container(section, resolve=False), "")


def _compose(path: Path, user: dict, lines: Dict[str, int], extra: List[tuple], overrides: List[str]):
    """(config, where each key came from, problems): the file, then `extra` (key, value) pairs, then the overrides."""
    cfg = OmegaConf.structured(Recipe)
    origin: Dict[str, str] = {}  # dotted key -> where its value came from
    problems: List[str] = []

    def where_file(key: str) -> str:
        line = lines.get(key)
        return f"{path}:{line}" if line else str(path)

    merge.apply(cfg, user, Recipe, "", where_file, origin, problems)
    for key, value in extra:
        merge.apply_at(cfg, key, value, lambda _k, key=key: f"{where_file('on_cpu.' + key)}: on_cpu", origin, problems)
    for item in overrides:
        parsed = merge.parse_override(item)
        shown = merge.quoted(item)
        if isinstance(parsed, str):
            problems.append(f"override '{shown}': {parsed}")
            continue
        merge.apply_at(cfg, *parsed, lambda _k, shown=shown: f"override '{shown}'", origin, problems)
    return cfg, origin, problems


def _make_importable(path: Path) -> None:
    """The working directory, the recipe's folder, and the root of the package holding it are importable."""
    folder = path.resolve().parent
    root = folder
    while (root / "__init__.py").exists() and root.parent != root:
        root = root.parent
    for entry in (root, folder, Path.cwd()):
        if str(entry) not in sys.path:
            sys.path.insert(0, str(entry))


def _resolve_all(cfg: Any, prefix: str, where, reported: set) -> List[str]:
    """Resolve every value; report missing ones and broken interpolations (unless already reported)."""
    problems = []
    keys = cfg.keys() if isinstance(cfg, DictConfig) else range(len(cfg))
    for key in keys:
        full = f"{prefix}{key}"
        if full in reported:
            continue
        if OmegaConf.is_missing(cfg, key):
            problems.append(f"{where(full)}: {full}: required value is missing")
            continue
        try:
            value = cfg[key]
        except (MissingMandatoryValue, InterpolationToMissingValueError):
            continue  # it points at a missing value, which is reported under its own key
        except OmegaConfBaseException as e:
            raw = OmegaConf.to_container(cfg, resolve=False)[key]
            problems.append(f"{where(full)}: {full}: cannot resolve {short(raw)}: {first_line(e)}")
            continue
        if OmegaConf.is_config(value):
            problems += _resolve_all(value, full + ".", where, reported)
    return problems
