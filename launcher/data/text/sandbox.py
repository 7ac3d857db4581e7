"""Chat templates compiled and rendered within bounds (bounds.py says which and why).

transformers renders a template with jinja2's ImmutableSandboxedEnvironment, adding its own filters
(`tojson`), globals (`raise_exception`, `strftime_now`, `dict`, `namespace`) and extensions (`{% generation %}`,
loop controls). `Metered` is that environment with each of them, metered where Jinja gives a hook:

- binary operators (`call_binop`) and every call (`call`: functions, methods, macros) are checked before
  (bounds.binop, bounds.method) and their results measured after; each call is a step;
- each filter is wrapped alike (FILTERS: the checks of those whose result its input does not bound);
- the compiled code is generated with hooks of its own (`Code`): `~` joins measured before they are made, list,
  tuple and dict literals measured, each loop iteration a step (its iterable wrapped, `Metered.counted`), and
  template text written counted (where a `{% set %}` block may keep it); every `{{ }}` goes through
  `finalize`, at render time (constant folding is off: nothing of the template runs while it compiles);
- `{% generation %}` blocks (`Generation`) say where they start from the characters written so far, as
  transformers' tracker does, without joining the output at each one.

`render` gives the text (and the generation spans) as transformers' `render_jinja_template` gives them, the
conversation passed as `apply_chat_template(messages, tools=...)` passes it."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

from launcher.data.text import bounds
from launcher.data.text.bounds import Meter, TemplateBound

COMPILING = Meter(bounds.FLOOR, bounds.BUDGET * bounds.FLOOR, bounds.STEPS)  # the bounds while a template compiles


class Code(CodeGenerator):
    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        joined = ("(markup_join if context.eval_ctx.volatile else str_join)" if frame.eval_ctx.volatile else
                  "markup_join" if frame.eval_ctx.autoescape else "str_join")
        self.write(f"environment.joined({joined}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_List(self, node: nodes.List, frame) -> None:
        self._literal(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame) -> None:
        self._literal(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame) -> None:
        if node.ctx != "load":  # an assignment's targets: `{% for a, b in ... %}`
            return super().visit_Tuple(node, frame)
        self._literal(super().visit_Tuple, node, frame)

    def visit_Output(self, node: nodes.Output, frame) -> None:
        text = sum(len(child.data) for child in node.nodes if isinstance(child, nodes.TemplateData))
        self.writeline(f"environment.wrote({text})")
        super().visit_Output(node, frame)

    def _literal(self, visit, node, frame) -> None:
        self.write("environment.held(")
        visit(node, frame)
        self.write(")")


class Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: the block's characters, from those written before it, kept
    where the rendering asks for them (transformers' AssistantTracker, with a count instead of a join)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        text = caller()
        meter = bounds.current()
        if meter.spans is not None:
            meter.spans.append((meter.written, meter.written + len(text)))
        return text


class Metered(ImmutableSandboxedEnvironment):
    code_generator_class = Code
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        meter = bounds.current()
        bounds.binop(meter, operator, left, right)
        return meter.made(self.binop_table[operator](left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        meter = bounds.current()
        meter.step()
        wrapped = getattr(__obj, "__wrapped__", None)  # str.format, as the sandbox hands it out
        if getattr(wrapped, "__name__", "") in ("format", "format_map") and isinstance(wrapped.__self__, str):
            mapping = wrapped.__name__ == "format_map" and args and isinstance(args[0], Mapping)
            bounds.braces(meter, wrapped.__self__, () if mapping else args, dict(args[0]) if mapping else kwargs)
        elif getattr(__obj, "__name__", "") == "join" and isinstance(getattr(__obj, "__self__", None), (str, bytes)):
            items = list(args[0]) if args else []
            meter.fits(sum(meter.size(item) for item in items) + len(__obj.__self__) * len(items), "a joined string")
            args = (items,)
        else:
            bounds.method(meter, __obj, args, kwargs)
        return meter.made(super().call(__context, __obj, *args, **kwargs))

    def joined(self, join, values: tuple) -> str:  # (Environment.concat is Jinja's own)
        meter = bounds.current()
        meter.fits(sum(meter.size(value) for value in values), "a joined string (~)")
        return meter.made(join(values))

    def held(self, value: Any) -> Any:
        return bounds.current().made(value)

    def wrote(self, characters: int) -> None:
        bounds.current().wrote(characters)

    def counted(self, iterable: Any):
        meter = bounds.current()
        for item in iterable:
            meter.step()
            yield item


@jinja2.pass_eval_context  # one that takes a context: no output is worked out while the template compiles
def _finalize(eval_ctx, value: Any) -> Any:
    """Each `{{ ... }}`: its value printable within the limit (a list printed is its elements printed)."""
    meter = bounds.current()
    meter.step()
    meter.spent += meter.size(value)
    return value


def _checked(name: str, check, filter):
    """The filter, its result measured, and checked before where `check` (its arguments by name) says."""
    passes = _PassArg.from_obj(filter) is not None
    signature = inspect.signature(filter) if check else None
    # Jinja's async variants take the context their sync function's signature does not show
    skip = int(passes and check is not None and next(iter(signature.parameters)) not in CONTEXTS)

    @functools.wraps(filter)
    def checked(*args, **kwargs):
        meter = bounds.current()
        meter.step()
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
    return args, kwargs


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
    meter.fits((len(indent) if isinstance(indent, str) else bounds._int(indent)) * bounds.MAX_DEPTH, "a JSON indentation")
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
           "pprint": _printed, "urlencode": _printed, "xmlattr": _printed, "e": _printed, "escape": _printed,
           "forceescape": _printed, "urlize": _printed}


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
    from jinja2.utils import generate_lorem_ipsum

    bounds.current().fits(bounds._int(n) * bounds._int(max) * 16, "lorem ipsum")
    return generate_lorem_ipsum(n, html, min, max)


@lru_cache(maxsize=None)
def environment() -> Metered:
    """transformers' chat template environment, metered: its options, filters, globals and extensions."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    theirs = _compile_jinja_template("").environment
    extensions = [type(e) for e in theirs.extensions.values() if "generation" not in getattr(e, "tags", ())]
    ours = Metered(trim_blocks=theirs.trim_blocks, lstrip_blocks=theirs.lstrip_blocks, optimized=False,
                   extensions=[*extensions, Generation], finalize=_finalize)
    ours.globals.update(theirs.globals)
    ours.globals["lipsum"] = _lipsum
    ours.filters.update({name: _checked(name, FILTERS.get(name), f) for name, f in {**theirs.filters, "sum": _sum}.items()})
    return ours


@lru_cache(maxsize=8)
def compiled(template: str) -> jinja2.Template:
    """The template compiled (jinja2.TemplateSyntaxError where it is not Jinja; TemplateBound past bounds)."""
    token = bounds.metering(Meter(COMPILING.limit, COMPILING.budget, COMPILING.most_steps))
    try:
        tree = environment().parse(template)
        for loop in list(tree.find_all(nodes.For)):  # each iteration a step
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)
        return environment().from_string(tree)
    finally:
        bounds.stop_metering(token)


def reads(template: str) -> Tuple[frozenset, frozenset]:
    """What the template reads: the variables it takes (messages, tools, ...), and every name it looks up
    or string it holds (which a message's keys are compared with: `message.tool_calls`, `'tool_calls' in m`)."""
    from jinja2 import meta

    tree = environment().parse(template)
    names = {n.attr for n in tree.find_all(nodes.Getattr)}
    names |= {n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)}
    return frozenset(meta.find_undeclared_variables(tree)), frozenset(names)


def render(template: str, messages: List[Dict[str, Any]], tools: Optional[list], variables: Dict[str, Any],
           meter: Meter, prompt: bool = False, marked: bool = False) -> Tuple[str, List[tuple]]:
    """The text of the conversation (and, `marked`, its generation blocks' spans), as transformers renders
    it, within `meter`'s bounds: TemplateBound past them."""
    from transformers.utils import chat_template_utils as theirs

    plain = getattr(theirs, "_plain_template_data", lambda value: value)
    alias = getattr(theirs, "_alias_reasoning_fields", lambda chat: chat)
    chat = alias(plain(messages))
    meter.spans = [] if marked else None
    token = bounds.metering(meter)
    try:
        pieces = []
        for piece in compiled(template).generate(messages=chat, tools=plain(tools), documents=None,
                                                 add_generation_prompt=prompt, **plain(variables)):
            meter.written += len(piece)
            meter.fits(meter.written, "an output")
            pieces.append(piece)
        return "".join(pieces), meter.spans or []
    finally:
        bounds.stop_metering(token)
