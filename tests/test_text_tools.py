"""Chat rows as OpenAI's and TRL's tool-calling and multimodal-shaped data writes them (launcher/data/text/
conversation.py), read as `apply_chat_template(messages, tools=...)` reads them: an assistant's tool_calls with
no content, a row's tools handed to a Qwen2.5-style template (its schemas in the rendered text), a content of text
parts; a message's weight of 0 left out of the loss; a null column called null; and one line at start naming
what rows hold that the template never reads."""

import json

import pytest

from tests.text_folders import PARTS, QWEN25, tokenizer_folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.text import TextDataset  # noqa: E402
from launcher.errors import UserError  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
CALLING = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": CALL},
    {"role": "tool", "content": "Sunny, 21 degrees."},
    {"role": "assistant", "content": "It is sunny in Paris."},
]
PLAIN = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "3 plus 4 is 7."},
         {"role": "user", "content": "And 2 times 5?"}, {"role": "assistant", "content": "2 times 5 is 10."}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    where = tmp_path_factory.mktemp("tokenizers")
    return {"qwen": tokenizer_folder(where / "qwen", template=QWEN25), "chatml": tokenizer_folder(where / "chatml"),
            "parts": tokenizer_folder(where / "parts", template=PARTS),
            "marked": tokenizer_folder(where / "marked", marked=True)}


def jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def runs(tokenizer, sample):
    """The text of each run of labelled tokens."""
    out, run = [], []
    for token, label in zip(sample["input_ids"], sample["labels"]):
        if label != -100:
            run.append(token)
        elif run:
            out, run = out + [tokenizer.decode(run)], []
    return out + ([tokenizer.decode(run)] if run else [])


def refused(folder, path, **settings) -> str:
    with pytest.raises(UserError) as e:
        TextDataset(str(folder), path, cache=None, **settings)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("tools_as", ["list", "json"])
def test_a_tool_call_without_content_and_the_rows_tools_render_as_apply_chat_template_renders_them(folders, tmp_path,
                                                                                                    tools_as):
    tools = TOOLS if tools_as == "list" else json.dumps(TOOLS)  # a list kept as its JSON text, as Parquet files do
    data = TextDataset(str(folders["qwen"]), jsonl(tmp_path / "tools.jsonl", [{"messages": CALLING, "tools": tools}]),
                       cache=None)
    tokenizer, sample = data.tokenizer, data.samples[0]
    rendered = tokenizer.apply_chat_template(CALLING, tools=TOOLS, tokenize=False)
    assert sample["input_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(sample["input_ids"])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city ' \
           'today."' in text  # the schema the model is shown, before it calls it
    assert runs(tokenizer, sample) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is sunny in Paris.<|im_end|>"]
    assert not any("never reads" in line for line in data.notes)


def test_content_as_text_parts_is_read_by_a_template_that_reads_parts_and_joined_for_one_that_reads_strings(
        folders, tmp_path):
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}, {"type": "text", "text": "(end)"}]}
             for m in PLAIN]
    joined = [{**m, "content": m["content"] + "\n(end)"} for m in PLAIN]
    as_parts = TextDataset(str(folders["parts"]), jsonl(tmp_path / "parts.jsonl", [{"messages": parts}]), cache=None)
    tokenizer = as_parts.tokenizer
    rendered = tokenizer.apply_chat_template(parts, tokenize=False)  # the parts handed to the template as they are
    assert "3 plus 4 is 7.(end)<|im_end|>" in rendered
    assert as_parts.samples[0]["input_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert runs(tokenizer, as_parts.samples[0]) == ["3 plus 4 is 7.(end)<|im_end|>", "2 times 5 is 10.(end)<|im_end|>"]
    # ChatML reads strings alone (apply_chat_template would render the list's Python repr): joined by newlines
    strings = TextDataset(str(folders["chatml"]), jsonl(tmp_path / "parts.jsonl", [{"messages": parts}]), cache=None)
    again = TextDataset(str(folders["chatml"]), jsonl(tmp_path / "joined.jsonl", [{"messages": joined}]), cache=None)
    assert strings.samples == again.samples
    assert "'type'" not in strings.tokenizer.decode(strings.samples[0]["input_ids"])


def test_a_content_part_that_is_not_text_is_one_line(folders, tmp_path):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}},
                                          {"type": "text", "text": "What is this?"}]},
             {"role": "assistant", "content": "A cat."}]
    path = jsonl(tmp_path / "image.jsonl", [{"messages": image}])
    assert refused(folders["parts"], path) == (
        f"{path}, line 1: message 1 (user) has a content part of type 'image_url'; a text model's chat reads text "
        f"parts, {{\"type\": \"text\", \"text\": ...}} (bad_rows: skip would skip such rows and count them)")


@pytest.mark.parametrize("template", ["chatml", "marked"])
def test_an_answer_of_weight_0_is_left_out_of_the_loss(folders, tmp_path, template):
    weighted = [PLAIN[0], {**PLAIN[1], "weight": 0}, PLAIN[2], {**PLAIN[3], "weight": 1}]
    data = TextDataset(str(folders[template]), jsonl(tmp_path / "w.jsonl", [{"messages": weighted}]), cache=None)
    whole = TextDataset(str(folders[template]), jsonl(tmp_path / "p.jsonl", [{"messages": PLAIN}]), cache=None)
    assert data.samples[0]["input_ids"] == whole.samples[0]["input_ids"]
    assert runs(data.tokenizer, data.samples[0]) == ["2 times 5 is 10.<|im_end|>"]
    assert runs(data.tokenizer, whole.samples[0]) == ["3 plus 4 is 7.<|im_end|>", "2 times 5 is 10.<|im_end|>"]


@pytest.mark.parametrize("messages, settings, says", [
    ([PLAIN[0], {**PLAIN[1], "weight": 0.5}], {}, "message 2 (assistant) has the weight 0.5; a weight is 0 (left out "
                                                 "of the loss) or 1 (trained)"),
    ([{**PLAIN[0], "weight": 1}, PLAIN[1]], {}, "message 1 (user) has the weight 1; only assistant messages are "
                                                "trained, so only theirs can be 1"),
    ([PLAIN[0], {**PLAIN[1], "weight": 0}], {"loss_on": "all"},
     "message 2 (assistant) has the weight 0, and loss_on: all trains on every token; loss_on: answers leaves it out"),
])
def test_a_weight_the_launcher_cannot_honour_is_one_line(folders, tmp_path, messages, settings, says):
    path = jsonl(tmp_path / "w.jsonl", [{"messages": messages}])
    assert refused(folders["chatml"], path, **settings) == (f"{path}, line 1: {says} (bad_rows: skip would skip "
                                                            f"such rows and count them)")


def test_rows_whose_every_answer_weighs_0_are_nothing_to_learn_and_said_so(folders, tmp_path):
    path = jsonl(tmp_path / "w.jsonl", [{"messages": [PLAIN[0], {**PLAIN[1], "weight": 0}]}] * 2)
    assert refused(folders["chatml"], path) == (
        f"files: {path}: no samples in them: no row made a sample; 2 with nothing to learn (an empty text, or every "
        f"answer of weight 0); fix the rows")


def test_a_null_conversation_is_called_null(folders, tmp_path):
    path = jsonl(tmp_path / "null.jsonl", [{"messages": None}])
    assert refused(folders["chatml"], path) == (
        f"{path}, line 1: column 'messages' is null; it holds the conversation (a list of {{role, content}} messages) "
        f"(bad_rows: skip would skip such rows and count them)")


def test_what_rows_hold_that_the_template_never_reads_is_one_line_at_start(folders, tmp_path):
    rows = [{"id": 7, "messages": CALLING, "tools": TOOLS}, {"messages": PLAIN, "source": None}]
    chatml = TextDataset(str(folders["chatml"]), jsonl(tmp_path / "rows.jsonl", rows), cache=None)
    # ChatML writes no tools and no tool calls: the sample holds neither, and the line says so
    assert chatml.notes[2] == ("rows hold what the chat template never reads, so that no sample shows it: column "
                               "'id', column 'tools' (the template takes no tools), messages' 'tool_calls'")
    qwen = TextDataset(str(folders["qwen"]), jsonl(tmp_path / "rows.jsonl", rows), cache=None)
    assert qwen.notes[2] == "rows hold what the chat template never reads, so that no sample shows it: column 'id'"
    again = TextDataset(str(folders["qwen"]), jsonl(tmp_path / "rows.jsonl", rows), cache=str(tmp_path / "cache"))
    again = TextDataset(str(folders["qwen"]), jsonl(tmp_path / "rows.jsonl", rows), cache=str(tmp_path / "cache"))
    assert again.notes[-1].startswith("cache: hit") and again.notes[:-1] == qwen.notes[:-1]


def test_tool_calls_that_are_not_a_list_are_the_checks_line_even_without_content(folders, tmp_path):
    """Before, `content: null` let the row by before tool_calls were checked: the template's TypeError instead."""
    path = jsonl(tmp_path / "calls.jsonl", [{"messages": [PLAIN[0], {"role": "assistant", "content": None,
                                                                     "tool_calls": "get_weather(Paris)"}]}])
    assert refused(folders["qwen"], path) == (
        f"{path}, line 1: message 2 (assistant) has tool_calls 'get_weather(Paris)'; they are a list of calls, "
        f"{{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}} (bad_rows: skip would skip "
        f"such rows and count them)")


def test_a_nested_key_the_row_lacks_and_the_template_reads_is_named_as_the_rows(folders, tmp_path):
    """Qwen2.5's template writes a call's arguments with tojson: a call without them failed with 'Object of type
    Undefined is not JSON serializable', a line that named no key of the row."""
    lacking = [PLAIN[0], {"role": "assistant", "content": None,
                          "tool_calls": [{"type": "function", "function": {"name": "get_weather"}}]}]
    path = jsonl(tmp_path / "lacking.jsonl", [{"messages": lacking}])
    assert refused(folders["qwen"], path) == (
        f"{path}, line 1: the chat template fails on it: TypeError: Object of type Undefined is not JSON serializable "
        f"('dict object' has no attribute 'arguments': the row lacks what the template reads) (bad_rows: skip would "
        f"skip such rows and count them)")


@pytest.mark.parametrize("when", ["at start", "on a row"])
def test_a_template_that_fails_whatever_the_row_is_the_templates_line_whatever_bad_rows_says(tmp_path, when):
    """cycler() of nothing raises RuntimeError, which was said under the dataset's key (data.train) as if the
    data were wrong; a row that meets it is not skipped as malformed either."""
    from recipes.components.tiny_tokenizer import CHATML

    guard = "{% if messages | length > 2 %}" if when == "on a row" else "{% if true %}"
    folder = tokenizer_folder(tmp_path, template=guard + "{{ cycler().next() }}{% endif %}" + CHATML)
    path = jsonl(tmp_path / "chat.jsonl", [{"messages": PLAIN[:2]}, {"messages": PLAIN}])
    template = folder / "chat_template.jinja"
    said = refused(folder, path, bad_rows="skip")
    assert said == (f"{template}: the chat template fails whatever the row: RuntimeError: at least one item has to "
                    f"be provided" if when == "at start" else
                    f"{path}, line 2: {template}: the chat template fails whatever the row: RuntimeError: at least one "
                    f"item has to be provided"), said
