"""Chat templates compiled and rendered within bounds (bounds.py says which and why).

transformers renders a template with jinja2's ImmutableSandboxedEnvironment, adding its own filters
(`tojson`), globals (`raise_exception`, `strftime_now`, `dict`, `namespace`) and extensions (`{% generation %}`,
loop controls). `Metered` is that environment with each of them, metered where Jinja gives a hook:

- binary operators (`call_binop`) and every call (`call`: functions, methods, macros) are checked before
  (bounds.binop, bounds.method) and their results measured after; each call is a step;
- each filter is wrapped alike (filters.py: with a check before where its result is not bounded by its input);
- the compiled code is generated with hooks of its own (`Code`): `~` joins measured before they are made, list,
  tuple and dict literals measured, each loop iteration a step (its iterable wrapped, `Metered.counted`), and
  template text written counted (where a `{% set %}` block may keep it); every `{{ }}` goes through
  `finalize`, at render time (constant folding is off: nothing of the template runs while it compiles);
- `{% generation %}` blocks (`Generation`) say where they start from the characters written so far, as
  transformers' tracker does, without joining the output at each one.

`render` gives the text (and the generation spans) as transformers' `render_jinja_template` gives them, the
conversation passed as `apply_chat_template(messages, tools=...)` passes it."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from launcher.data.text import bounds, filters
from launcher.data.text.bounds import Meter, TemplateBound

class Code(CodeGenerator):
    """Jinja's Python code for a template, with the hooks Metered counts by (the optimizer is off: no folding)."""

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
        if text:  # (what {{ }} writes is finalize's to count)
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


class Undefined(jinja2.Undefined):
    """Jinja's Undefined (transformers renders with it), kept by the meter as the last one made: where a
    rendering fails on one (`tojson` of it), the line names what the row lacks rather than the template."""

    __slots__ = ()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        meter = bounds._CURRENT.get()
        if meter is not None:
            meter.undefined = self


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
            items = list(args[0]) if args else []  # a generator is read once, here: join gets the list
            meter.fits(sum(meter.size(item) for item in items) + len(__obj.__self__) * len(items), "a joined string")
            args = (items, *args[1:]) if args else args
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
    meter.spend(len(value) if type(value) is str and len(value) <= meter.limit else meter.size(value))
    return value


@lru_cache(maxsize=None)
def environment() -> Metered:
    """transformers' chat template environment, metered: its options, filters, globals and extensions."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    theirs = _compile_jinja_template("").environment
    extensions = [type(e) for e in theirs.extensions.values() if "generation" not in getattr(e, "tags", ())]
    ours = Metered(trim_blocks=theirs.trim_blocks, lstrip_blocks=theirs.lstrip_blocks, optimized=False,
                   extensions=[*extensions, Generation], finalize=_finalize, undefined=Undefined)
    ours.globals.update(theirs.globals)
    ours.globals["lipsum"] = filters.lipsum
    ours.filters.update(filters.metered(theirs.filters))
    return ours


@lru_cache(maxsize=8)
def compiled(template: str) -> jinja2.Template:
    """The template compiled (jinja2.TemplateSyntaxError where it is not Jinja; TemplateBound past bounds)."""
    token = bounds.metering(Meter(bounds.FLOOR, bounds.BUDGET * bounds.FLOOR, bounds.STEPS))
    try:
        if len(template) > bounds.TEMPLATE_CHARACTERS:
            raise TemplateBound(f"is {len(template):,} characters, more than the {bounds.TEMPLATE_CHARACTERS:,} a chat "
                                f"template may have")
        tree = environment().parse(template)
        parts = sum(1 for _ in tree.find_all(nodes.Node))
        if parts > bounds.TEMPLATE_NODES:  # Jinja's code generation is quadratic in some shapes: its time bounded
            raise TemplateBound(f"is {parts:,} expressions and statements, more than the {bounds.TEMPLATE_NODES:,} a "
                                f"chat template may have")
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


def plain(messages: List[Dict[str, Any]], tools: Optional[list] = None) -> Tuple[list, Optional[list]]:
    """The conversation and tools as transformers hands them to a template (plain JSON types, reasoning fields
    aliased): message by message, so that the first k of it are the first k messages made plain."""
    from transformers.utils import chat_template_utils as theirs

    alias = getattr(theirs, "_alias_reasoning_fields", lambda chat: chat)
    return alias(_plain(messages)), _plain(tools)


def _plain(value: Any) -> Any:
    from transformers.utils import chat_template_utils as theirs

    return getattr(theirs, "_plain_template_data", lambda given: given)(value)


def render(template: str, messages: List[Dict[str, Any]], tools: Optional[list], variables: Dict[str, Any],
           meter: Meter, prompt: bool = False, marked: bool = False, made_plain: bool = False) -> Tuple[str, List[tuple]]:
    """The text of the conversation (and, `marked`, its generation blocks' spans), as transformers renders
    it, within `meter`'s bounds: TemplateBound past them. `made_plain`: the messages and tools are `plain`'s."""
    chat, tools = (messages, tools) if made_plain else plain(messages, tools)
    variables = _plain(variables)
    meter.spans = [] if marked else None
    token = bounds.metering(meter)
    try:
        pieces = compiled(template).generate(messages=chat, tools=tools, documents=None,
                                             add_generation_prompt=prompt, **variables)
        if not marked:  # every piece was spent of the budget as it was written: the output is joined after
            text = "".join(pieces)
            meter.fits(len(text), "an output")
            return text, []
        written = []
        for piece in pieces:  # the generation blocks' spans are counted from the characters written so far
            meter.written += len(piece)
            meter.fits(meter.written, "an output")
            written.append(piece)
        return "".join(written), meter.spans
    finally:
        bounds.stop_metering(token)
