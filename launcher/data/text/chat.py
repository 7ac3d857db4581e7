"""The `chat` format: a column holding a conversation, a list of `{role, content}` messages, rendered by a chat
template (the tokenizer's own, or one the recipe gives) and trained on its assistant turns.

Where each answer lies in the rendered text, in characters, is found in one of two ways:

- **markers**: a template with `{% generation %}...{% endgeneration %}` says it itself; transformers'
  renderer returns those spans (what `apply_chat_template(..., return_assistant_tokens_mask=True)` reads).
- **prefixes**, for every other template (most models' own: Llama, Qwen, Mistral, Gemma have no markers): an
  assistant message k starts where the conversation's first k messages end, rendered with the generation
  prompt (the role header the template writes before an answer), and ends where the first k + 1 end, less
  the whitespace after the end-of-turn token. So the answer covers the assistant's content and its
  end-of-turn token, not the role header nor the newline between turns, as TRL's `assistant_only_loss`
  templates mark it. It holds where the template renders a conversation's beginning as the beginning of the
  whole; one that does not (one that drops earlier turns' reasoning) is one line, never a wrong mask.

Markers are taken where the template has them: they are its author's word on what the answer is, and need one
rendering instead of two per answer."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from launcher.data.text.formats import BadRow, Sample, Span, column, labelled
from launcher.errors import UserError, first_line, short

ROLES = ("system", "user", "assistant", "tool")
MARKERS = re.compile(r"\{%-?\s*generation\s*-?%\}")
SPANS = ("auto", "markers", "prefixes")


class BadTemplate(Exception):
    """The chat template cannot show where this row's answers are: said with the row, never skipped."""


class Chat:
    roles = {"messages": "the conversation"}

    def __init__(self, tokenizer: Any, columns: Dict[str, str], loss_on: str, template: str, spans: str = "auto"):
        if spans not in SPANS:
            raise ValueError(f"spans: {spans!r} is not one of {', '.join(SPANS)}")
        self.tokenizer, self.name, self.loss_on, self.template = tokenizer, columns["messages"], loss_on, template
        self.markers = bool(MARKERS.search(template)) if spans == "auto" else spans == "markers"
        if self.markers and not MARKERS.search(template):
            raise ValueError("spans: markers, and the chat template has no {% generation %} block")
        # what apply_chat_template gives a template beside the messages: bos_token, eos_token, ...
        self.variables = dict(tokenizer.special_tokens_map)
        self._compiles()

    def __call__(self, row: Dict[str, Any]) -> Sample:
        messages = self.messages(column(row, self.name, list, "the conversation (a list of {role, content} messages)"))
        if self.loss_on == "all":
            return labelled(self.tokenizer, self.render(messages)[0], [], "all")
        text, spans = self.answers(messages)
        return labelled(self.tokenizer, text, spans, "answers")

    def described(self, given: Optional[str]) -> str:
        whose = "the recipe's chat_template" if given is not None else "the tokenizer's chat template"
        return (f"{whose}, its answers marked by its {{% generation %}} blocks" if self.markers else
                f"{whose}, its answers found by rendering each conversation's beginnings")

    def messages(self, messages: List[Any]) -> List[Dict[str, Any]]:
        if not messages:
            raise BadRow("an empty conversation; a chat row holds a list of {role, content} messages, an "
                         "assistant's among them")
        for i, message in enumerate(messages, 1):
            if not isinstance(message, dict):
                raise BadRow(f"message {i} is {type(message).__name__} {short(message)}; a message is an object "
                             f"with a role and a content")
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise BadRow(f"message {i} has the role {short(role)}; a role is one of {', '.join(ROLES)}")
            if not isinstance(content, str):
                raise BadRow(f"message {i} ({role}) has the content {short(content)}; a content is a string")
        if self.loss_on == "answers" and not any(m["role"] == "assistant" for m in messages):
            raise BadRow("no assistant message, so nothing to learn from it (loss_on: answers trains on the "
                         "assistant's messages)")
        # keys without a value dropped, as apply_chat_template drops them: columnar files (Parquet, Arrow) give
        # every message every key some message has, None where it has none, and templates test `is defined`
        return [{key: value for key, value in m.items() if value is not None} for m in messages]

    def answers(self, messages: List[Dict[str, Any]]) -> Tuple[str, List[Span]]:
        """The conversation rendered, and its answers' spans in it."""
        text, marked = self.render(messages, marked=self.markers)
        if self.markers:
            return text, [tuple(span) for span in marked]
        prefixes: Dict[Tuple[int, bool], str] = {}

        def prefix(k: int, prompt: bool) -> str:  # the first k messages, rendered as the beginning of `text`
            if (k, prompt) not in prefixes:
                rendered = self.render(messages[:k], prompt=prompt)[0]
                if not text.startswith(rendered):
                    what = f"its first {k} messages" + (" with a generation prompt" if prompt else "")
                    raise BadTemplate(f"the chat template renders {what} as a text that is not how it renders the whole "
                                      f"conversation (it ends {short(rendered[-60:])}), so the answers cannot be "
                                      f"found: give the template {{% generation %}} markers around each answer, or "
                                      f"give a chat_template that renders a conversation's beginning alike")
                prefixes[k, prompt] = rendered
            return prefixes[k, prompt]

        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start, end = len(prefix(k, True)), len(prefix(k + 1, False))
            if start == len(prefix(k, False)):  # the template writes no generation prompt: the answer is its content
                found = text.find(message["content"].strip(), start, end)
                if found < 0:
                    raise BadTemplate(f"the chat template writes no generation prompt and changes message {k + 1}'s "
                                      f"content, so where the answer starts cannot be found: give it "
                                      f"{{% generation %}} markers")
                start = found
            while end > start and text[end - 1].isspace():
                end -= 1
            spans.append((start, end))
        return text, spans

    def render(self, messages: List[Dict[str, Any]], prompt: bool = False, marked: bool = False) -> Tuple[str, list]:
        """The template's text of `messages` (by transformers' sandboxed Jinja, as apply_chat_template renders
        it), and with `marked` its {% generation %} spans."""
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, spans = render_jinja_template(conversations=[messages], chat_template=self.template,
                                                    add_generation_prompt=prompt, return_assistant_tokens_mask=marked,
                                                    **self.variables)
        except jinja2.TemplateSyntaxError:
            raise  # the template itself, found when the format is made (_compiles)
        except jinja2.TemplateError as e:
            raise BadRow(f"the chat template refuses it: {first_line(e)[:200]}") from None
        return rendered[0], spans[0] if marked else []

    def _compiles(self) -> None:
        import jinja2

        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
        try:
            self.render(probe, marked=self.markers)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"chat_template: not a Jinja template: {first_line(e)} (line {e.lineno})") from None
        except BadRow:
            pass  # the template's own rules (say, a system message first) are for each row to meet
