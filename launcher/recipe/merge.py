"""A recipe's keys set into the schema one by one: a recipe file's mapping, its on_cpu keys, and the command
line's `key=value` overrides (parsed as OmegaConf's dotlist parses them), each walked down the schema's
sections, so that every unknown key and every value of the wrong type is one problem of its own and none
hides the next (launcher/recipe/load.py collects them).

Inside a free mapping (model, data.train, ...) the rest of a key is that component's argument: an override
may create the mapping (as Hydra's `+key.arg=value` does), and a whole mapping replaces the one before. A
key inside a section that holds an unresolved interpolation (`data=${x}`, then `data.batch_size=3`) is a
problem, not a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.errors import short, shown
from launcher.recipe import yamlfile
from launcher.recipe.schema import Recipe


def parse_override(item: str) -> tuple | str:
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


def quoted(item: str, most: int = 80) -> str:
    """An override as a message quotes it: printable, one line, and not endless."""
    return shown(item, most)


def apply(cfg: DictConfig, data: dict, schema: type, prefix: str, where, origin, problems) -> None:
    """Merge a recipe file's `data` into `cfg` key by key, so that every bad key or value is reported."""
    for key, value in data.items():
        apply_at(cfg, f"{prefix}{key}", value, where, origin, problems, schema, len(prefix.split(".")) - 1)


def apply_at(cfg: DictConfig, dotted: str, value: Any, where, origin, problems,
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
            problems.append(f"{where(full)}: {quoted(full)}: unknown key; {hint}")
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
                apply(cfg, value, kind, full + ".", where, origin, problems)
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
