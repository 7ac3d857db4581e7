"""The `preference` format: a row of a prompt and two answers to it, one preferred (`chosen`) and one not
(`rejected`), made into two samples that share the prompt, as TRL's `DPOTrainer` reads such rows:

- **strings** (TRL's standard format): each answer is the prompt's completion, made as `prompt_completion`
  makes a row (formats.PromptCompletion: joined by `template`, or one after the other; EOS after it);
- **conversations** (TRL's conversational format): `prompt` is the conversation before the answer (a list of
  messages), `chosen` and `rejected` the assistant's message(s) after it; each answer is rendered after the
  prompt by the chat template and found as chat.py finds an answer (a row's `tools` go to the template);
- without a `prompt` column (TRL's implicit prompt), the prompt is what `chosen` and `rejected` begin alike
  with, as TRL's `extract_prompt` takes it.

Labels are on the answer alone: never on the prompt, not even on the assistant turns a prompt's conversation
holds. A row whose answers are of two kinds, or an answer with no assistant message, is a BadRow (one line
naming the file and row, or skipped under `bad_rows: skip`); a conversation without a chat template is a
BadTemplate (one line, whatever `bad_rows` says). Each sequence is tokenized whole, as the other formats'."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

from launcher.data.text import conversation
from launcher.data.text.chat import BadTemplate, Chat
from launcher.data.text.formats import BadRow, PromptCompletion, Sample, labelled, sized
from launcher.errors import short

Pair = Tuple[Sample, Sample]  # (prompt + chosen, prompt + rejected)
ANSWERS = ("chosen", "rejected")


class Preference:
    roles = {"prompt": "the prompt", "chosen": "the preferred answer", "rejected": "the rejected answer",
             "tools": "the tools (JSON schemas) a conversation may call"}

    def __init__(self, tokenizer: Any, columns: Dict[str, str], loss_on: str, template: Optional[str],
                 chat_template: Optional[str], max_len: Optional[int] = None, origin: str = "the chat template"):
        self.tokenizer, self.columns, self.max_len = tokenizer, columns, max_len
        self.strings = PromptCompletion(tokenizer, {"prompt": "prompt", "completion": "completion"}, "answers",
                                        template, max_len)
        # a folder without a chat template serves pairs of strings; a conversation then says it needs one
        self.chat = None if chat_template is None else Chat(tokenizer, {"messages": "messages", "tools": "tools"},
                                                            "answers", chat_template, origin=origin, max_len=max_len)

    def __call__(self, row: Dict[str, Any]) -> Optional[Pair]:
        """The pair's two samples, or None where either answer has nothing to learn (every weight 0)."""
        prompt, answers = self._parts(row)
        if isinstance(prompt, str):
            made = [self.strings({"prompt": prompt, "completion": answer}) for answer in answers]
        else:
            tools = conversation.tools(row.get(self.columns["tools"]), self.columns["tools"])
            made = [self._conversation(prompt, answer, name, tools) for answer, name in zip(answers, ANSWERS)]
        return None if None in made else (made[0], made[1])

    def described(self, given: Optional[str]) -> str:
        if self.chat is None:
            return "no chat template: pairs of strings only (a conversation needs the dataset's chat_template)"
        return f"pairs of strings, or conversations by {self.chat.described(given)}"

    def unread(self, row: Dict[str, Any]) -> Set[str]:
        """What a conversation's row holds that the chat template never reads (chat.py's `unread`, over its
        three conversations, and the columns beside them); nothing for pairs of strings, as prompt_completion."""
        messages = [m for name in ("prompt", *ANSWERS) if isinstance(row.get(self.columns[name]), list)
                    for m in row[self.columns[name]]]
        if self.chat is None or not messages:
            return set()
        named = set(self.columns.values())
        said = {f"column {name!r}" for name, value in row.items() if value is not None and name not in named}
        return said | self.chat.unread({"messages": messages, "tools": row.get(self.columns["tools"])})

    def _parts(self, row: Dict[str, Any]) -> Tuple[Any, List[Any]]:
        """The prompt and the two answers, of one kind (strings, or lists of messages), or BadRow."""
        names = self.columns
        answers = [_answer(row, names[name]) for name in ANSWERS]
        if names["prompt"] in row:
            prompt = row[names["prompt"]]
            if not isinstance(prompt, (str, list)):
                raise BadRow(f"column {names['prompt']!r} holds {type(prompt).__name__} {short(prompt)}; the prompt is "
                             f"a string, or a conversation (a list of {{role, content}} messages)")
        else:
            prompt, answers = _extracted(*answers)
        for answer, name in zip(answers, ANSWERS):
            if isinstance(answer, str) != isinstance(prompt, str):
                kinds = ["a string" if isinstance(value, str) else "a list" for value in (answer, prompt)]
                raise BadRow(f"column {names[name]!r} holds {kinds[0]} and column {names['prompt']!r} {kinds[1]}; a "
                             f"pair is of strings, or of conversations (prompt, chosen and rejected lists of messages)")
        return prompt, answers

    def _conversation(self, prompt: List[Any], answer: List[Any], name: str, tools: Optional[list]) -> Optional[Sample]:
        """The prompt then this answer, rendered; the labels on the answer's assistant messages alone."""
        if self.chat is None:
            raise BadTemplate(f"a conversation, and the tokenizer has no chat template (chat_template.jinja, or "
                              f"chat_template in tokenizer_config.json): give one as the dataset's chat_template")
        column = self.columns[name]
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in answer):
            raise BadRow(f"column {column!r} holds no assistant message ({short(answer)}); an answer is the "
                         f"assistant's message(s) after the prompt, [{{\"role\": \"assistant\", \"content\": ...}}]")
        for i, m in enumerate(answer, 1):  # as an empty string is refused: it would train the end of turn alone
            if isinstance(m, dict) and m.get("role") == "assistant" and not _said(m):
                raise BadRow(f"column {column!r}: message {i} is the assistant's with nothing in it ({short(m)}); an "
                             f"answer's message holds a non-empty content, or tool_calls")
        given = prompt + answer
        size = sized(conversation.characters([given, tools]), self.max_len)
        try:
            messages, weights = conversation.messages(given, "answers", self.chat.lists)
        except BadRow as e:
            raise BadRow(f"{self.columns['prompt']!r} then {column!r} (messages 1 to {len(prompt)} the prompt's): "
                         f"{e}") from None
        asked = sum(1 for m in prompt if isinstance(m, dict) and m.get("role") == "assistant")
        weights = [False] * asked + weights[asked:]  # the prompt's own answers are context, not the answer
        if not any(weights):
            return None
        text, spans = self.chat.answers(messages, tools, weights, size)
        if weights[-1] and messages[-1]["role"] == "assistant":
            # scored to the text's end, as TRL's DPOTrainer scores what follows the prompt: the end of turn and
            # what the template writes after it (ChatML's newline), which chat.py leaves out of SFT's answers
            spans = [*spans[:-1], (spans[-1][0], len(text))]
        return labelled(self.tokenizer, text, spans, "answers")


def _said(message: Dict[str, Any]) -> bool:
    """Whether an assistant message holds anything: text that is not blank, tool calls, or reasoning."""
    return bool(conversation.text_of(message).strip() or message.get("tool_calls")
                or any(message.get(key) for key in conversation.REASONING))


def _answer(row: Dict[str, Any], name: str) -> Any:
    if name not in row:
        raise BadRow(f"no column {name!r}; a preference row holds prompt, chosen and rejected (TRL's format), or "
                     f"chosen and rejected alone; it has {', '.join(map(repr, row)) or 'none'}")
    value = row[name]
    if not isinstance(value, (str, list)) or not value:
        raise BadRow(f"column {name!r} holds {type(value).__name__} {short(value)}; an answer is a non-empty string, "
                     f"or the assistant's message(s), a list of {{role, content}} messages")
    return value


def _extracted(chosen: Any, rejected: Any) -> Tuple[Any, List[Any]]:
    """TRL's implicit prompt: what `chosen` and `rejected` begin alike with (for strings, less the space before
    where they part), and the answers after it."""
    if type(chosen) is not type(rejected):
        raise BadRow("no prompt column, and chosen and rejected are of two kinds; without a prompt they are two "
                     "strings, or two conversations that begin alike")
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if isinstance(chosen, str) and k and chosen[k - 1] == " ":
        k -= 1
    if k == len(chosen) or k == len(rejected):
        raise BadRow("no prompt column, and one of chosen and rejected is the beginning of the other, so that "
                     "no answer is left of it; give a prompt column")
    return chosen[:k], [chosen[k:], rejected[k:]]
