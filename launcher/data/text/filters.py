"""Jinja's filters (and transformers' `tojson`) metered for sandbox.py: each a step, its result measured and spent
of the budget (bounds.Meter.made), and, where its result can be large from small inputs (a width, a repeated
separator, an indentation), its size worked out from its arguments and refused before it is made (FILTERS).
`sum` of lists is joined at once, not copied at each item (quadratic in C, where no step is counted)."""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Callable, Dict

import jinja2
from jinja2.utils import _PassArg

from launcher.data.text import bounds


def metered(given: Dict[str, Callable]) -> Dict[str, Callable]:
    """The filters `given` (an environment's), each metered."""
    return {name: _checked(name, FILTERS.get(name), f) for name, f in {**given, "sum": _sum}.items()}


def _checked(name: str, check, filter):
    """The filter, its input read (Meter.read), its result measured, and checked before where `check` (its
    arguments by name) says."""
    passes = _PassArg.from_obj(filter) is not None
    signature = inspect.signature(filter) if check else None
    # Jinja's async variants take the context their sync function's signature does not show
    skip = int(passes and check is not None and next(iter(signature.parameters)) not in CONTEXTS)

    reads = name not in CONSTANT
    at = 1 if passes else 0  # the filter's input: its first argument after the context Jinja passes

    @functools.wraps(filter)
    def checked(*args, **kwargs):
        meter = bounds.current()
        meter.step()
        if reads and len(args) > at:
            meter.read(meter.size(args[at]))
        if check:
            named = signature.bind(*args[skip:], **kwargs)
            named.apply_defaults()
            args, kwargs = check(meter, named.arguments, args, kwargs, passes)
        return meter.made(filter(*args, **kwargs))

    return checked


CONTEXTS = ("eval_ctx", "environment", "env", "context")


def _value(named: dict) -> Any:
    return next(v for k, v in named.items() if k not in CONTEXTS)


def _padded(meter, named, args, kwargs, passes):
    meter.fits(max(meter.size(_value(named)), bounds._int(named["width"])), "a centered string")
    return args, kwargs


def _indented(meter, named, args, kwargs, passes):
    text, width = named["s"], named["width"]
    lines = str(text).count("\n") + 1 if meter.size(text) else 1
    meter.fits(meter.size(text) + lines * (len(width) if isinstance(width, str) else bounds._int(width)),
               "an indented string")
    return args, kwargs


def _formatted(meter, named, args, kwargs, passes):
    bounds.percent(meter, str(named["value"]), tuple(named["args"]) or dict(named["kwargs"]))
    return args, kwargs


def _joined(meter, named, args, kwargs, passes):
    items = list(named["value"])  # a generator is read once, here: the filter gets the list
    meter.fits(sum(meter.size(item) for item in items) + meter.size(named["d"]) * len(items), "a joined string")
    at = 1 if passes else 0
    return (*args[:at], items, *args[at + 1:]), kwargs


def _replaced(meter, named, args, kwargs, passes):
    count = -1 if named["count"] is None else named["count"]
    text, old, new = (str(value) if meter.size(value) else "" for value in (named["s"], named["old"], named["new"]))
    bounds.replaced(meter, text, old, new, count)
    return args, kwargs


def _wrapped(meter, named, args, kwargs, passes):
    text, width, wrap = str(named["s"]) if meter.size(named["s"]) else "", named["width"], named["wrapstring"]
    breaks = len(text) // max(bounds._int(width), 1) + text.count("\n") + 1
    meter.fits(len(text) + breaks * (meter.size(wrap) if wrap is not None else 1), "a wrapped string")
    if named["break_long_words"]:  # textwrap cuts a long word a line at a time, copying the rest of it each time
        width = max(bounds._int(width), 1)
        meter.read(sum(len(word) * len(word) // (2 * width) for word in text.split() if len(word) > width))
    return args, kwargs


def _linked(meter, named, args, kwargs, passes):
    """urlize: its patterns search each word from each of its characters (a word of ')' is quadratic)."""
    text = str(_value(named)) if meter.size(_value(named)) else ""
    meter.read(sum(len(word) * len(word) for word in text.split()))
    return _printed(meter, named, args, kwargs, passes)


def _pretty(meter, named, args, kwargs, passes):
    meter.read(bounds.MAX_DEPTH * meter.size(_value(named)))  # pprint writes each level's items again at each level
    return _printed(meter, named, args, kwargs, passes)


def _grouped(meter, named, args, kwargs, passes):
    count = named.get("linecount", named.get("slices"))
    meter.fits(bounds._int(count), "a list of groups")
    return args, kwargs


def _printed(meter, named, args, kwargs, passes):
    meter.fits(6 * meter.size(_value(named)), "a printed value")  # an escape is at most 6 characters
    return args, kwargs


def _json(meter, named, args, kwargs, passes):
    value, indent, separators = named["x"], named["indent"], named["separators"]
    # the encoder makes each line's indentation before writing it
    width = len(indent) if isinstance(indent, str) else bounds._int(indent)
    meter.fits(width * bounds.MAX_DEPTH, "a JSON indentation")
    if indent is None and separators is None and 6 * meter.size(value) <= meter.limit:
        return args, kwargs  # an escape is at most 6 characters, a separator 2 and an element counts 1
    written = 0  # else written a piece at a time (iterencode: the pure-Python encoder), each counted
    for piece in json.JSONEncoder(ensure_ascii=named["ensure_ascii"], indent=indent, separators=separators,
                                  sort_keys=named["sort_keys"]).iterencode(value):
        written += len(piece)
        meter.fits(written, "a JSON text")
    return args, kwargs


@jinja2.pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    """Jinja's sum, of lists and tuples joined at once: sum() copies the total at each item."""
    from jinja2.filters import make_attrgetter, sync_do_sum

    if not isinstance(start, (list, tuple)):
        return sync_do_sum(environment, iterable, attribute, start)
    items = list(iterable if attribute is None else map(make_attrgetter(environment, attribute), iterable))
    meter = bounds.current()
    meter.fits(meter.size(start) + sum(meter.size(item) for item in items), "a summed list")
    for item in items:
        if type(item) is not type(start):
            raise TypeError(f"can only concatenate {type(start).__name__} (not {type(item).__name__}) to it")
    return type(start)(value for part in (start, *items) for value in part)


FILTERS = {"center": _padded, "indent": _indented, "format": _formatted, "join": _joined, "replace": _replaced,
           "wordwrap": _wrapped, "batch": _grouped, "slice": _grouped, "tojson": _json, "string": _printed,
           "pprint": _pretty, "urlencode": _printed, "xmlattr": _printed, "e": _printed, "escape": _printed,
           "forceescape": _printed, "urlize": _linked}
# Filters whose time does not grow with their input (a container's length, its first item): nothing read.
CONSTANT = frozenset({"length", "count", "first", "last", "default", "d", "random", "attr", "abs", "round", "safe",
                      "items", "batch", "slice", "int", "float"})


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
    from jinja2.utils import generate_lorem_ipsum

    bounds.current().fits(bounds._int(n) * bounds._int(max) * 16, "lorem ipsum")
    return generate_lorem_ipsum(n, html, min, max)
