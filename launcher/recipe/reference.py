"""The recipe reference, docs/recipe.md, generated from the schema: every key with its type, default and
meaning (the comment beside its field in launcher/recipe/schema.py, or in the module of the section it
imports: ranks.py, slurm_options.py, fault_tolerance.py).

    python -m launcher.recipe.reference > docs/recipe.md       # tests/test_readme.py checks it is current
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any, Iterator, Tuple

from omegaconf import MISSING

from launcher.recipe import schema
from launcher.recipe.schema import Recipe

HEADER = """# Recipe reference

Every key of a recipe: its type, its default, and what it does. Generated from `launcher/recipe/schema.py`
(and the sections it imports: `launcher/recipe/ranks.py`, `launcher/recipe/slurm_options.py`,
`launcher/recipe/fault_tolerance.py`) by `python -m launcher.recipe.reference > docs/recipe.md`; [Writing recipes](writing-recipes.md#every-key-as-one-recipe)
shows them as one recipe. A component (`model`, `loss`, `optimizer`, `data.train`, ...) is a mapping with `_target_` (the
dotted path of a callable) and its keyword arguments.

| key | type | default | meaning |
|---|---|---|---|
"""


NAMED = {"on_cpu": "mapping of recipe keys or null", "parallel.tp_plan": "auto or mapping of str"}  # Any, in words


def _type(kind: Any) -> str:
    text = re.sub(r"typing\.|launcher\.recipe\.schema\.", "", str(kind) if not isinstance(kind, type) else kind.__name__)
    text = text.replace("Dict[str, Dict[str, Any]]", "mapping of components").replace("Dict[str, Any]", "component")
    text = text.replace("List[str]", "list of str").replace("List[int]", "list of int").replace("Any", "str or list")
    optional = re.fullmatch(r"Optional\[(.*)\]", text)
    return f"{optional.group(1)} or null" if optional else text


def _default(f: dataclasses.Field) -> str:
    if f.default is MISSING or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
        return "required"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _comments(cls: type) -> dict:
    """field name -> the comment on its line in the class's source."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+):.*?\s#\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def keys(cls: type = Recipe, prefix: str = "") -> Iterator[Tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every key, sections walked in the schema's order."""
    hints, comments = typing.get_type_hints(cls, vars(schema)), _comments(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        inner = [k for k in typing.get_args(kind) if k is not type(None)]
        if dataclasses.is_dataclass(kind):
            yield from keys(kind, f"{prefix}{f.name}.")
        elif len(inner) == 1 and dataclasses.is_dataclass(inner[0]):  # an optional section: off when null
            yield prefix + f.name, "section or null", _default(f), comments.get(f.name, "")
            yield from keys(inner[0], f"{prefix}{f.name}.")
        else:
            shown = NAMED.get(prefix + f.name) or _type(kind)
            yield prefix + f.name, shown, _default(f), comments.get(f.name, "")


def render() -> str:
    rows = [f"| `{key}` | {kind} | {default} | {meaning.replace('|', '/').replace('<', '&lt;')} |"
            for key, kind, default, meaning in keys()]
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
