"""A chat row's conversation and tools, read as `apply_chat_template(messages, tools=...)` reads them, and as
OpenAI's and TRL's data writes them:

- a message is `{role, content}` with a role of system, user, assistant or tool; keys without a value are
  dropped (columnar files give every message every key some message has, None where it has none, and
  templates test `is defined`);
- an assistant message that calls tools holds `tool_calls` and may have no content (`content: null`);
- a content may be a list of parts, `[{"type": "text", "text": ...}]`: handed to a template that reads such
  lists as it is; for one that reads strings alone, its text parts joined by newlines (as vLLM joins them for
  such templates); a part of another type (an image) is refused, a text model reading none;
- `weight` (OpenAI's fine-tuning format): 1 trains an assistant message (the default), 0 leaves it out of the
  loss; no other value, and no weight on another role's message but 0;
- a row's `tools`: a list of JSON schemas (or a string holding one, as datasets stored in Parquet often keep
  them), handed to the template as `tools`."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from launcher.data.text.formats import BadRow
from launcher.errors import a_kind, short

ROLES = ("system", "user", "assistant", "tool")
READ = ("role", "content", "weight")  # what every template reads, or the launcher reads itself
REASONING = ("reasoning_content", "thinking", "reasoning")  # one key under three names (transformers aliases them)


def messages(given: List[Any], loss_on: str, lists: bool) -> Tuple[List[Dict[str, Any]], List[bool]]:
    """The messages as the template gets them, and whether each assistant message is trained (its weight)."""
    if not given:
        raise BadRow("an empty conversation; a chat row holds a list of {role, content} messages, an "
                     "assistant's among them")
    out, weights = [], []
    for i, message in enumerate(given, 1):
        if not isinstance(message, dict):
            raise BadRow(f"message {i} is {type(message).__name__} {short(message)}; a message is an object "
                         f"with a role and a content")
        role = message.get("role")
        if role not in ROLES:
            raise BadRow(f"message {i} has the role {short(role)}; a role is one of {', '.join(ROLES)}")
        message = {key: value for key, value in message.items() if value is not None}
        _content(message, i, lists)
        trained = _weight(message, i, loss_on)
        if role == "assistant":
            weights.append(trained)
        out.append(message)
    if loss_on == "answers" and not weights:
        raise BadRow("no assistant message, so nothing to learn from it (loss_on: answers trains on the "
                     "assistant's messages)")
    return out, weights


def _content(message: Dict[str, Any], i: int, lists: bool) -> None:
    role, content = message["role"], message.get("content")
    if "tool_calls" in message and not isinstance(message["tool_calls"], list):  # before a content of none is let by
        raise BadRow(f"message {i} ({role}) has tool_calls {short(message['tool_calls'])}; they are a list of "
                     f"calls, {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}}")
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            return  # a call of tools, nothing said
        raise BadRow(f"message {i} ({role}) has no content; a content is a string (or a list of text parts), "
                     f"and an assistant's may be left out where it holds tool_calls")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                what = f"of type {short(kind)}" if isinstance(kind, str) and kind != "text" else short(part)
                raise BadRow(f"message {i} ({role}) has a content part {what}; a text model's chat reads text "
                             f"parts, {{\"type\": \"text\", \"text\": ...}}")
            texts.append(part["text"])
        if not lists:  # the template reads strings alone
            message["content"] = "\n".join(texts)
    elif not isinstance(content, str):
        raise BadRow(f"message {i} ({role}) has the content {short(content)}; a content is a string, or a list "
                     f"of text parts")


def _weight(message: Dict[str, Any], i: int, loss_on: str) -> bool:
    """Whether the message is trained (assistant messages), from its weight."""
    weight = message.get("weight", 1)
    role = message["role"]
    if isinstance(weight, bool) or weight not in (0, 1):
        raise BadRow(f"message {i} ({role}) has the weight {short(weight)}; a weight is 0 (left out of the loss) "
                     f"or 1 (trained)")
    if weight == 1 and "weight" in message and role != "assistant":
        raise BadRow(f"message {i} ({role}) has the weight 1; only assistant messages are trained, so only "
                     f"theirs can be 1")
    if weight == 0 and role == "assistant" and loss_on == "all":
        raise BadRow(f"message {i} (assistant) has the weight 0, and loss_on: all trains on every token; "
                     f"loss_on: answers leaves it out")
    return weight == 1


def tools(value: Any, name: str) -> Optional[list]:
    """A row's tools: a list of JSON schemas (objects), or None where it has none."""
    if value is None:
        return None
    if isinstance(value, str):  # a list stored as its JSON text
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise BadRow(f"column {name!r} holds a string that is not JSON ({short(value)}); tools are a list of "
                         f"JSON schemas, or the JSON text of one") from None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise BadRow(f"column {name!r} holds {a_kind(value)} {short(value)}; tools are a list of JSON schemas, "
                     f"{{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}")
    return value


def text_of(message: Dict[str, Any]) -> str:
    """The message's text: its content, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content if isinstance(content, str) else ""


def characters(value: Any) -> int:
    """The characters of every string in `value` (keys too), one more for each element: what a template's bounds
    and a row's size are reckoned in (bounds.Meter.size counts alike)."""
    total, stack = 0, [value]
    while stack:  # not recursive: a row nested a thousand levels deep is read by Python's json
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += 1 + len(item)
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            total += 1 + len(item)
            stack += item
        else:
            total += 1
    return total
