"""What a chat template's rendering may spend, and the checks that keep it there (sandbox.py applies them).

A template is untrusted code (DESIGN, invariant 13). jinja2's sandbox keeps it from Python's internals, not from
the machine's memory and time: `'a' * 3000000000` allocates 3 GB in one operation, two nested `range(100000)`
loops run 10**10 times. A `Meter` holds, for one rendering, bounds that grow with its input (`for_input`):

- `limit`: the characters any one value may hold, the output among them. A value's size is deep (a list
  counts its elements' sizes, each element one more), so that a list of references to one long string
  cannot be joined or printed into a huge one. Where an operation's result can be large from small inputs
  (`*`, `**`, `%`, `~`, `center`, `join`, `indent`, `tojson`, ...), its size is worked out from its
  inputs and refused before anything is built; other results are measured after (they are at most a few
  times their inputs, which were measured themselves).
- `budget`: the characters all the values made may add up to (so that a loop cannot hold many values of
  the limit's size at once); and, apart, the characters every filter and method reads (its input, times the
  passes it makes over it where its time grows faster: `wordwrap`, `urlize`), so that each call's time is
  bounded by its input's size, deterministically.
- `steps`: loop iterations, calls and writes; deterministic, so every rank stops at the same place.
- `seconds`: a backstop of wall-clock time, checked every STRIDE steps, for an operation slow on its own.

Each is a `TemplateBound` naming what was exceeded."""

from __future__ import annotations

import re
import string
import time
from collections.abc import ItemsView, KeysView, Mapping, ValuesView
from contextvars import ContextVar
from typing import Any, Dict, List, Optional

FLOOR = 1 << 20  # characters a rendering may hold whatever its input: system prompts, tool instructions
GROWTH = 8  # and this many times its input's characters
BUDGET = 16  # all the values it makes: this many times the limit
STEPS = 1_000_000  # loop iterations, calls and writes, plus STEPS_PER_CHARACTER a character of input
STEPS_PER_CHARACTER = 16
SECONDS = 60.0
STRIDE = 4096  # steps between two looks at the clock
MAX_BITS = 8192  # an integer the template makes (10**2466); chat templates count messages
MAX_DEPTH = 100  # levels of nested lists and dicts
# What a template may be, so that compiling it is bounded too (a 1 MiB one compiled for more than 18 minutes: Jinja's
# code generation grows with the square of the names a loop's branches set). Chat templates shipped with models are
# a few hundred to two thousand nodes (Qwen2.5's tool calling: 188); 10,000 compile in about 2 s of CPU at worst.
TEMPLATE_CHARACTERS = 1 << 18
TEMPLATE_NODES = 10_000
PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")
NUMBER = re.compile(r"\d+")


class TemplateBound(Exception):
    """A rendering went past one of its bounds; the message says which, in a clause."""


class Meter:
    """The bounds of one rendering (or of a compilation) and what it has spent of them."""

    def __init__(self, limit: int, budget: int, steps: int, seconds: float = SECONDS):
        self.limit, self.budget, self.most_steps = limit, budget, steps
        self.deadline, self.seconds = time.monotonic() + seconds, seconds
        self.steps = self.spent = self.written = self.read_characters = 0
        self.spans: Optional[List[tuple]] = None  # {% generation %} blocks' characters, where asked for
        self._sizes: Dict[int, int] = {}  # containers' deep sizes (immutable in the sandbox), by id
        self._held: List[Any] = []  # ... kept alive while their ids are keys
        self.undefined: Any = None  # the last value the template looked up and the row lacks (sandbox.Undefined)

    @classmethod
    def for_input(cls, characters: int) -> "Meter":
        limit = FLOOR + GROWTH * characters
        return cls(limit, BUDGET * limit, STEPS + STEPS_PER_CHARACTER * characters)

    def said(self) -> str:
        """The bounds, for a line."""
        return (f"{self.limit:,} characters a value, {self.budget:,} made in all, {self.most_steps:,} steps, "
                f"{self.seconds:.0f} seconds")

    def step(self, count: int = 1) -> None:
        self.steps += count
        if self.steps > self.most_steps:
            raise TemplateBound(f"ran more than {self.most_steps:,} steps: loop iterations, calls and writes")
        if self.steps % STRIDE < count and time.monotonic() > self.deadline:
            raise TemplateBound(f"ran longer than {self.seconds:.0f} s")

    def fits(self, size: int, what: str) -> None:
        """Refuses an operation whose result would hold `size` characters, over the limit."""
        if size > self.limit:
            raise TemplateBound(f"would make {what} of {size:,} characters, more than the {self.limit:,} a value "
                                f"may hold")

    def made(self, value: Any) -> Any:
        """`value`, a result: its size within the limit, and its new characters spent of the budget."""
        self.size(value)
        self.spend(len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 1)
        return value

    def wrote(self, characters: int) -> None:
        """Template text written (where a block may keep it): a step, and spent."""
        self.step()
        self.spend(characters)

    def spend(self, characters: int) -> None:
        self.spent += characters
        if self.spent > self.budget:
            raise TemplateBound(f"made more than {self.budget:,} characters of values in all")

    def read(self, characters: int) -> None:
        """What a filter or a method reads (its input), and works through more than once where its time grows
        faster than its input: within the budget too, so that no call takes a time its values do not bound."""
        self.read_characters += characters
        if self.read_characters > self.budget:
            raise TemplateBound(f"read more than {self.budget:,} characters in all (each filter and method reads its "
                                f"input; some, several times over)")

    def size(self, value: Any, depth: int = 0) -> int:
        """The deep size of `value` (characters of its strings, one more for each element), or TemplateBound
        as soon as it passes the limit."""
        if isinstance(value, (str, bytes, bytearray)):
            if len(value) > self.limit:
                self.fits(len(value), "a string")
            return len(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return 1 + value.bit_length() // 8
        if isinstance(value, range):
            return len(value)
        # the parts of a container, each a tuple of what it holds; and whether its size can be kept by its id (a
        # list or dict is not changed in the sandbox; a namespace's attributes are, a dict's view is made anew)
        if type(value).__name__ in NAMESPACES:
            parts, kept = object.__getattribute__(value, "_Namespace__attrs").items(), False
        elif isinstance(value, (Mapping, ItemsView)):
            parts, kept = value.items() if isinstance(value, Mapping) else value, not isinstance(value, ItemsView)
        elif isinstance(value, (list, tuple, set, frozenset, KeysView, ValuesView)):
            parts, kept = ((item,) for item in value), not isinstance(value, (KeysView, ValuesView))
        else:
            return 1  # a number, None, a loop, a macro, an undefined value
        known = self._sizes.get(id(value)) if kept else None
        if known is not None:
            return known
        if depth > MAX_DEPTH:
            raise TemplateBound(f"nests values more than {MAX_DEPTH} levels deep")
        total = 1
        for part in parts:
            total += 1 + sum(self.size(item, depth + 1) for item in part)
            if total > self.limit:
                self.fits(total, "a value")
        if kept:
            self._sizes[id(value)] = total
            self._held.append(value)
        return total


NAMESPACES = ("Namespace", "TemplateNamespace")
_CURRENT: ContextVar[Optional[Meter]] = ContextVar("launcher_template_meter", default=None)


def current() -> Meter:
    meter = _CURRENT.get()
    if meter is None:  # every rendering and compilation runs under one (sandbox.py)
        raise RuntimeError("a chat template ran without its meter")
    return meter


def metering(meter: Meter):
    """Sets `meter` as the current one; returns the token that `stop_metering` takes."""
    return _CURRENT.set(meter)


def stop_metering(token) -> None:
    _CURRENT.reset(token)


# Checks made before an operation whose result's size its inputs do not bound.

def binop(meter: Meter, operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        sequence, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(times, int) and isinstance(sequence, (str, bytes, list, tuple)):
            meter.fits(meter.size(sequence) * max(times, 0), "a repeated value")
        elif _integer(left) and _integer(right):
            _bits(left.bit_length() + right.bit_length())
    elif operator == "**" and _integer(left) and _integer(right) and right > 0 and abs(left) > 1:
        _bits(left.bit_length() * right if right < MAX_BITS else MAX_BITS + 1)
    elif operator == "+" and isinstance(left, (str, bytes, list, tuple)) and type(left) is type(right):
        meter.fits(meter.size(left) + meter.size(right), "a joined value")
    elif operator == "%" and isinstance(left, str):
        percent(meter, left, right)


def percent(meter: Meter, text: str, values: Any) -> None:
    """`text % values`: each conversion at most the largest value, padded to its width or precision."""
    given = list(values) if isinstance(values, tuple) else list(values.values()) if isinstance(values, Mapping) \
        else [values]
    widest = max([meter.size(v) for v in given] or [0])
    numbers = [abs(v) for v in given if _integer(v)]
    fields = 0
    for width, precision, _ in PERCENT.findall(text):
        fields += 1
        for part in (width, precision):
            widest = max(widest, max(numbers or [0]) if part == "*" else int(part) if part else 0)
    meter.fits(len(text) + fields * widest, "a formatted string")


def braces(meter: Meter, text: str, args: tuple, kwargs: dict) -> None:
    """`text.format(...)`: each field at most the largest value, padded to the largest width in a spec."""
    values = [*args, *kwargs.values()]
    widest = max([meter.size(v) for v in values] or [0])
    widths = [abs(v) for v in values if _integer(v)]
    fields = 0
    try:
        for _, name, spec, _ in string.Formatter().parse(text):
            if name is not None:
                fields += 1
                widths += [int(n) for n in NUMBER.findall(spec or "")]
    except ValueError:
        return  # not a format string: str.format says so itself
    meter.fits(len(text) + fields * (widest + max(widths or [0])), "a formatted string")


def method(meter: Meter, bound: Any, args: tuple, kwargs: dict) -> None:
    """A method of a string, bytes or an integer that can make a large result from small arguments."""
    owner, name = getattr(bound, "__self__", None), getattr(bound, "__name__", "")
    if isinstance(owner, int) and not isinstance(owner, bool) and name == "to_bytes":
        meter.fits(_int(args[0] if args else kwargs.get("length", 1)), "bytes")
    if not isinstance(owner, (str, bytes)):
        if isinstance(owner, (list, tuple)):  # index, count: a pass over it
            meter.read(len(owner))
        return
    n = len(owner)
    if name in ("center", "ljust", "rjust", "zfill") and args:
        meter.fits(max(n, _int(args[0])), "a padded string")
    elif name == "expandtabs":
        meter.fits(n + owner.count("\t" if isinstance(owner, str) else b"\t")
                   * _int(args[0] if args else kwargs.get("tabsize", 8)), "a string")
    elif name == "replace" and len(args) >= 2:
        replaced(meter, owner, args[0], args[1], args[2] if len(args) > 2 else -1)
    elif name == "translate" and args:  # a table is any value with items (str.translate looks each up)
        table = args[0]
        values = table.values() if isinstance(table, Mapping) else table if isinstance(table, (list, tuple)) else None
        widest = max([meter.size(v) for v in values] or [1]) if values is not None else \
            1 if isinstance(table, (str, bytes, range)) else meter.limit + 1
        meter.fits(n * widest, "a translated string")
    elif name in ("encode", "decode"):
        codec = args[0] if args else kwargs.get("encoding", "utf-8")
        if not isinstance(codec, str) or _codec(codec) not in LINEAR_CODECS:
            raise TemplateBound(f"would {name} with {str(codec)[:40]!r}, a codec whose time may grow faster than its "
                                f"input; a chat template may use {', '.join(LINEAR_CODECS)}")
    meter.read(n + sum(len(a) for a in args if isinstance(a, (str, bytes))))


LINEAR_CODECS = ("utf-8", "ascii", "latin-1", "utf-16", "utf-32")  # in C, one pass (punycode, idna: Python, quadratic)


def _codec(name: str) -> str:
    import codecs

    try:
        found = codecs.lookup(name).name
    except LookupError:
        return name  # str.encode says so itself
    return {"iso8859-1": "latin-1"}.get(found, found)


def replaced(meter: Meter, text: Any, old: Any, new: Any, count: Any) -> None:
    if not isinstance(old, type(text)) or not isinstance(new, type(text)):
        return  # str.replace refuses it itself
    found = text.count(old) if old else len(text) + 1
    if _integer(count) and count >= 0:
        found = min(found, count)
    meter.fits(len(text) + found * max(0, len(new) - len(old)), "a replaced string")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any) -> int:
    return abs(value) if _integer(value) else 0


def _bits(bits: int) -> None:
    if bits > MAX_BITS:
        raise TemplateBound(f"would make an integer of more than {MAX_BITS:,} bits")
