"""Load a recipe: YAML file + key=value overrides, merged into the schema by OmegaConf.

Every problem is collected and reported at once, each on one line that names the
file (and line) or the override it came from. OmegaConf does the merging, type
conversion and interpolation; this module only walks the input key by key so one
bad value does not hide the next.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue, OmegaConfBaseException

from launcher.errors import UserError, first_line, short
from launcher.recipe import targets, yamlfile
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

    _apply(cfg, user, Recipe, "", where_file, origin, problems)
    for key, value in extra:
        _apply_at(cfg, key, value, lambda _k, key=key: f"{where_file('on_cpu.' + key)}: on_cpu", origin, problems)
    for item in overrides:
        parsed = _parse_override(item)
        shown = _shown(item)
        if isinstance(parsed, str):
            problems.append(f"override '{shown}': {parsed}")
            continue
        _apply_at(cfg, *parsed, lambda _k, shown=shown: f"override '{shown}'", origin, problems)
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


def _parse_override(item: str) -> tuple | str:
    """(dotted key, value) of `key=value`, the value parsed as OmegaConf's dotlist does; or what is wrong."""
    key, eq, text = item.partition("=")
    if not eq or not key or not all(part.isidentifier() for part in key.split(".")):
        return "expected key=value with a dotted key, e.g. trainer.max_steps=100"
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell passed through that are not UTF-8 (surrogate escapes)
        return "holds bytes that are not UTF-8 text; write the value in UTF-8"
    try:
        yamlfile.compose(text)  # OmegaConf's C parser would crash on deep nesting rather than raise
    except yamlfile.TooDeep as e:
        return f"cannot parse the value: {e}"
    except yaml.YAMLError:
        pass  # OmegaConf's own parse below says what is wrong
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:  # ValueError: an integer of >4300 digits
        return f"cannot parse the value: {yamlfile.problem(e)}"
    for part in key.split("."):
        value = value[part]
    return key, value


def _shown(item: str, most: int = 80) -> str:
    """An override as a message quotes it: printable, one line, and not endless."""
    shown = item if item.isprintable() else item.encode("unicode_escape", "backslashreplace").decode()
    return shown if len(shown) <= most else f"{shown[:most]}... ({len(item)} characters)"


def _apply(cfg: DictConfig, data: dict, schema: type, prefix: str, where, origin, problems) -> None:
    """Merge a recipe file's `data` into `cfg` key by key, so that every bad key or value is reported."""
    for key, value in data.items():
        _apply_at(cfg, f"{prefix}{key}", value, where, origin, problems, schema, len(prefix.split(".")) - 1)


def _apply_at(cfg: DictConfig, dotted: str, value: Any, where, origin, problems,
              schema: type = Recipe, depth: int = 0) -> None:
    """Set `dotted` to `value`, walking the schema's sections; inside a free mapping (model, data.train,
    ...) the rest of the key is that component's argument. A whole mapping replaces the one before:
    a new `_target_` takes none of the old arguments."""
    parts = dotted.split(".")
    for i in range(depth, len(parts)):
        fields = {f.name for f in dataclasses.fields(schema)}
        prefix, full = ".".join(parts[:i]), ".".join(parts[:i + 1])
        if parts[i] not in fields:
            close = difflib.get_close_matches(parts[i], fields, n=1)
            dot = f"{prefix}." if prefix else ""
            hint = f"did you mean '{dot}{close[0]}'?" if close else f"valid keys: {', '.join(sorted(fields))}"
            problems.append(f"{where(full)}: {_shown(full)}: unknown key; {hint}")
            return
        kind = typing.get_type_hints(schema)[parts[i]]
        section = _section(kind)
        if section is not None and (i < len(parts) - 1 or isinstance(value, dict)):
            kind = section
            held = _interpolation(cfg, full)
            if held is not None:  # `data=${x}` then `data.batch_size=3`: a key inside a value not yet resolved
                problems.append(f"{where(dotted)}: {dotted}: {full} is {short(held)}, an interpolation, not a "
                                f"section whose keys can be set one by one; set {full} as a mapping, or leave the "
                                f"interpolation out")
                return
            _fill(cfg, full, section)  # an optional section (logging.mlflow) that was null gets its defaults
        if dataclasses.is_dataclass(kind):
            if i == len(parts) - 1 and isinstance(value, dict):
                _apply(cfg, value, kind, full + ".", where, origin, problems)
                return
            if i < len(parts) - 1:
                schema = kind
                continue
        break
    try:
        if full != dotted and _is_mapping(kind) and _open(cfg, full):
            origin[full] = where(dotted)  # the mapping is this override's now
        OmegaConf.update(cfg, dotted, value, merge=False)
    except OmegaConfBaseException:
        if full != dotted and not _is_mapping(kind) and kind is not Any:
            problems.append(f"{where(dotted)}: {dotted}: {full} is {_describe(kind)}, not a mapping; set it "
                            f"whole, as {full}=...")
            return
        shown = _describe(kind) if full == dotted else "a value its component accepts"
        problems.append(f"{where(dotted)}: {dotted}: expected {shown}, got {short(value)}")
        return
    origin[dotted] = where(dotted)


def _section(kind: Any) -> Optional[type]:
    """The dataclass of a schema field typed as one, or as Optional[one]."""
    if dataclasses.is_dataclass(kind):
        return kind
    found = [k for k in typing.get_args(kind) if dataclasses.is_dataclass(k)]
    return found[0] if found else None


def _interpolation(cfg: DictConfig, key: str) -> Optional[str]:
    """The `${...}` that `key` holds, unresolved (resolving it may fail, or give a value of another type); else None."""
    parent_key, _, last = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg  # a section walked into: not an interpolation
    return str(parent._get_node(last)._value()) if OmegaConf.is_interpolation(parent, last) else None


def _fill(cfg: DictConfig, key: str, section: type) -> None:
    if OmegaConf.select(cfg, key) is None:
        OmegaConf.update(cfg, key, OmegaConf.structured(section), merge=False)


def _open(cfg: DictConfig, key: str) -> bool:
    """Make the component mapping `key` an empty one when it is null or missing, so that `key.arg=value`
    creates it (as Hydra's `+key.arg=value` does) instead of failing inside OmegaConf. True if it did."""
    parent_key, _, last = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg  # a schema section: never null
    if OmegaConf.is_missing(parent, last) or (not OmegaConf.is_interpolation(parent, last) and parent[last] is None):
        OmegaConf.update(cfg, key, {}, merge=False)
        return True
    return False


def _is_mapping(kind: Any) -> bool:
    """Whether a schema field's type is a mapping (Dict[...] or Optional[Dict[...]])."""
    return any(typing.get_origin(k) is dict for k in (kind, *typing.get_args(kind)))


def _describe(kind: Any) -> str:
    if dataclasses.is_dataclass(kind):
        return f"a mapping of {', '.join(f.name for f in dataclasses.fields(kind))}"
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    optional = len(args) < len(typing.get_args(kind))
    base = args[0] if optional and len(args) == 1 else kind
    if dataclasses.is_dataclass(base):
        text = f"a mapping of {', '.join(f.name for f in dataclasses.fields(base))} ({{}} for the defaults)"
    elif typing.get_origin(base) is dict:
        text = "a mapping such as {_target_: dotted.path, ...}"
    elif typing.get_origin(base) is list:
        text = "a list such as [a, b]"
    else:
        text = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(base, str(base))
    return f"{text} or null" if optional else text


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
