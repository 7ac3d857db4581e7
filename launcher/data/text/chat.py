"""The `chat` format: a column holding a conversation, a list of `{role, content}` messages (and a `tools`
column, where a row has one), rendered by a chat template (the tokenizer's own, or one the recipe gives) and
trained on its assistant turns.

Rows are read as `apply_chat_template(messages, tools=...)` reads them, as OpenAI's and TRL's tool-calling data
writes them (conversation.py): an assistant message may hold `tool_calls` and no content, a content may be a
list of text parts, and a row's `tools` (a list of JSON schemas, or a string of one) go to the template. A
message's `weight` (OpenAI's fine-tuning format) of 0 leaves that answer out of the loss.

Where each answer lies in the rendered text, in characters, is found in one of two ways:

- **markers**: a template with `{% generation %}...{% endgeneration %}` says it itself; the renderer returns
  those spans (what `apply_chat_template(..., return_assistant_tokens_mask=True)` reads).
- **prefixes**, for every other template (most models' own: Llama, Qwen, Mistral, Gemma have no markers): an
  assistant message k starts where the conversation's first k messages end, rendered with the generation
  prompt (the role header the template writes before an answer), and ends where the first k + 1 end, less
  the whitespace after the end-of-turn token. So the answer covers the assistant's content and its
  end-of-turn token, not the role header nor the newline between turns, as TRL's `assistant_only_loss`
  templates mark it. It holds where the template renders a conversation's beginning as the beginning of the
  whole; one that does not (one that drops earlier turns' reasoning) is one line, never a wrong mask.

Markers are taken where the template has them: they are its author's word on what the answer is, and need one
rendering instead of two per answer.

The template is untrusted code: it renders in sandbox.py, within bounds that grow with the row (bounds.py); a
rendering past them is one line naming the template and the bound, whatever `bad_rows` says. A row of more
characters than max_len tokens can use (formats.ROW_CHARACTERS a token) is refused before it is rendered."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Set, Tuple

from launcher.data.text import conversation, sandbox
from launcher.data.text.bounds import Meter, TemplateBound
from launcher.data.text.formats import BadRow, Sample, Span, column, labelled, sized
from launcher.errors import UserError, first_line, short

MARKERS = re.compile(r"\{%-?\s*generation\s*-?%\}")
SPANS = ("auto", "markers", "prefixes")
# Messages a row may have where its answers are found by prefixes: a rendering of its beginning for each answer,
# time that grows with the square of its messages (256 short messages: 0.1 s of CPU with ChatML, 0.5 s with
# Qwen2.5's template; 512: 0.3 s and 2 s; the row bound would let a row of max_len 2048 have ~5,000: minutes)
MAX_PREFIXED = 256
FAILURES = (ArithmeticError, LookupError, TypeError, ValueError, RecursionError)  # a template failing on a row


class BadTemplate(Exception):
    """The chat template cannot show where this row's answers are, or went past its bounds on it: said with
    the row, never skipped."""


class Chat:
    roles = {"messages": "the conversation", "tools": "the tools (JSON schemas) a conversation may call"}

    def __init__(self, tokenizer: Any, columns: Dict[str, str], loss_on: str, template: str, spans: str = "auto",
                 origin: str = "the chat template", max_len: Optional[int] = None):
        if spans not in SPANS:
            raise ValueError(f"spans: {spans!r} is not one of {', '.join(SPANS)}")
        self.tokenizer, self.loss_on, self.template, self.origin = tokenizer, loss_on, template, origin
        self.name, self.tools = columns["messages"], columns.get("tools", "tools")
        self.max_len = max_len
        self.markers = bool(MARKERS.search(template)) if spans == "auto" else spans == "markers"
        if self.markers and not MARKERS.search(template):
            raise ValueError("spans: markers, and the chat template has no {% generation %} block")
        # what apply_chat_template gives a template beside the messages: bos_token, eos_token, ...
        self.variables = dict(tokenizer.special_tokens_map)
        self.lists = False  # whether the template reads a content given as a list of parts (_compiles)
        self._compiles()
        self.variables_read, self.names_read = sandbox.reads(template)

    def __call__(self, row: Dict[str, Any]) -> Optional[Sample]:
        given = column(row, self.name, list, "the conversation (a list of {role, content} messages)")
        tools = conversation.tools(row.get(self.tools), self.tools)
        size = sized(conversation.characters([given, tools]), self.max_len)
        messages, weights = conversation.messages(given, self.loss_on, self.lists)
        if self.loss_on == "all":
            return labelled(self.tokenizer, self.render(messages, tools, size)[0], [], "all")
        if not any(weights):
            return None  # every answer weighted 0: nothing to learn
        text, spans = self.answers(messages, tools, weights, size)
        return labelled(self.tokenizer, text, spans, "answers")

    def described(self, given: Optional[str]) -> str:
        whose = "the recipe's chat_template" if given is not None else "the tokenizer's chat template"
        return (f"{whose}, its answers marked by its {{% generation %}} blocks" if self.markers else
                f"{whose}, its answers found by rendering each conversation's beginnings")

    def unread(self, row: Dict[str, Any]) -> Set[str]:
        """What this row holds that the template never reads (so that no sample shows it), in words."""
        said = {f"column {name!r}" for name, value in row.items() if value is not None and name not in
                (self.name, self.tools)}
        if row.get(self.tools) and "tools" not in self.variables_read:
            said.add(f"column {self.tools!r} (the template takes no tools)")
        messages = row.get(self.name)
        for message in messages if isinstance(messages, list) else []:
            for key in message if isinstance(message, dict) else ():
                if message[key] is not None and key not in conversation.READ and not self._reads(key):
                    said.add(f"messages' {key!r}")
        return said

    def _reads(self, key: str) -> bool:
        names = conversation.REASONING if key in conversation.REASONING else (key,)  # aliased as transformers does
        return any(name in self.names_read for name in names)

    def answers(self, messages: List[Dict[str, Any]], tools: Optional[list], weights: List[bool],
                size: int) -> Tuple[str, List[Span]]:
        """The conversation rendered, and its trained answers' spans in it (those of weight 1)."""
        if not self.markers and len(messages) > MAX_PREFIXED:
            raise BadRow(f"{len(messages):,} messages, more than the {MAX_PREFIXED} a row may have where the answers "
                         f"are found by rendering each conversation's beginning (a rendering for each answer: time "
                         f"that grows with the square of the messages); split the conversation, or give the chat "
                         f"template {{% generation %}} markers (one rendering a row)")
        messages, tools = sandbox.plain(messages, tools)  # once: each beginning renders a slice of them
        text, marked = self.render(messages, tools, size, marked=self.markers, made_plain=True)
        if self.markers:
            if all(weights):
                return text, [tuple(span) for span in marked]
            if len(marked) != len(weights):
                raise BadTemplate(f"the chat template marks {len(marked)} {{% generation %}} blocks for "
                                  f"{len(weights)} assistant messages, so which answer a weight of 0 leaves out "
                                  f"is not known: give one block an answer, or spans: prefixes")
            return text, [tuple(span) for span, weight in zip(marked, weights) if weight]
        prefixes: Dict[Tuple[int, bool], str] = {}

        def prefix(k: int, prompt: bool) -> str:  # the first k messages, rendered as the beginning of `text`
            if (k, prompt) not in prefixes:
                rendered = self.render(messages[:k], tools, size, prompt=prompt, made_plain=True)[0]
                if not text.startswith(rendered):
                    what = f"its first {k} messages" + (" with a generation prompt" if prompt else "")
                    raise BadTemplate(f"the chat template renders {what} as a text that is not how it renders the "
                                      f"whole conversation (it ends {short(rendered[-60:])}), so the answers cannot "
                                      f"be found: give the template {{% generation %}} markers around each answer, "
                                      f"or give a chat_template that renders a conversation's beginning alike")
                prefixes[k, prompt] = rendered
            return prefixes[k, prompt]

        spans, answer = [], 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            answer += 1
            if not weights[answer - 1]:
                continue
            start, end = len(prefix(k, True)), len(prefix(k + 1, False))
            if start == len(prefix(k, False)):  # the template writes no generation prompt: the answer is its content
                found = text.find(conversation.text_of(message).strip() or "\0", start, end)
                if found < 0:
                    raise BadTemplate(f"the chat template writes no generation prompt and changes message {k + 1}'s "
                                      f"content (or it has none), so where the answer starts cannot be found: give "
                                      f"it {{% generation %}} markers")
                start = found
            while end > start and text[end - 1].isspace():
                end -= 1
            spans.append((start, end))
        return text, spans

    def render(self, messages: List[Dict[str, Any]], tools: Optional[list], size: int, prompt: bool = False,
               marked: bool = False, made_plain: bool = False) -> Tuple[str, list]:
        """The template's text of `messages` (as apply_chat_template renders it, within the bounds of a row of
        `size` characters), and with `marked` its {% generation %} spans."""
        import jinja2

        bounded = Meter.for_input(size)
        try:
            return sandbox.render(self.template, messages, tools, self.variables, bounded, prompt, marked, made_plain)
        except TemplateBound as e:
            raise BadTemplate(f"{self.origin}: rendering this row, the chat template {e}: a template is untrusted "
                              f"code, and renders within bounds that grow with its row ({bounded.said()} "
                              f"here)") from None
        except jinja2.TemplateSyntaxError:
            raise  # the template itself, found when the format is made (_compiles)
        except jinja2.exceptions.SecurityError as e:  # what the sandbox keeps from any template, whatever the row
            raise BadTemplate(f"{self.origin}: the chat template does what the sandbox forbids: "
                              f"{first_line(e)[:200]}") from None
        except jinja2.TemplateError as e:
            raise BadRow(f"the chat template refuses it: {first_line(e)[:200]}") from None
        except FAILURES as e:
            missing = bounded.undefined if "Undefined" in str(e) else None  # a key the row lacks, as the cause
            lacks = f" ({missing._undefined_message}: the row lacks what the template reads)" if missing is not None else ""
            raise BadRow(f"the chat template fails on it: {type(e).__name__}: {first_line(e)[:200]}{lacks}") from None
        except RuntimeError as e:  # jinja's own helpers misused (cycler() of nothing): the template's mistake
            raise BadTemplate(f"{self.origin}: the chat template fails whatever the row: {type(e).__name__}: "
                              f"{first_line(e)[:200]}") from None

    def _compiles(self) -> None:
        """The template compiles and renders a short conversation within its bounds (on every rank, at start),
        and whether it reads a content given as a list of text parts."""
        import jinja2

        try:
            sandbox.compiled(self.template)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"chat_template: not a Jinja template: {first_line(e)} (line {e.lineno})") from None
        except TemplateBound as e:
            raise UserError(f"{self.origin}: the chat template cannot be compiled within bounds: it {e}") from None
        except (RecursionError, MemoryError, SyntaxError) as e:
            raise UserError(f"{self.origin}: the chat template cannot be compiled within bounds: "
                            f"{type(e).__name__}: {first_line(e)[:200]}") from None
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
        try:
            self.render(probe, None, 2, marked=self.markers)
        except BadTemplate as e:
            raise UserError(str(e).replace("rendering this row", "rendering a conversation of two messages at start",
                                           1)) from None
        except BadRow:
            pass  # the template's own rules (say, a system message first) are for each row to meet
        parts = [{"role": m["role"], "content": [{"type": "text", "text": f"\x01part {i}\x01"}]}
                 for i, m in enumerate(probe)]
        try:
            text = self.render(parts, None, 64)[0]
        except (BadRow, BadTemplate):
            return
        self.lists = all(f"\x01part {i}\x01" in text for i in range(2)) and "'type'" not in text
