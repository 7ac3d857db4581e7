"""The text formats (launcher/data/text/): a chat sample's labels are exactly its assistant turns with their
end-of-turn token, checked against the template's own rendering and against transformers' assistant mask of a
template with {% generation %} blocks, on two tokenizer layouts (a BPE with ChatML, GPT-2's byte level with a
Llama-3-like template); prompt/completion and text; over-long samples truncated or dropped, and counted."""

import json

import pytest

from tests.text_folders import END_OF_TURN, LAYOUTS, tokenizer_folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.collate import Pad  # noqa: E402
from launcher.data.text import TextDataset  # noqa: E402
from launcher.data.text.chat import Chat  # noqa: E402
from launcher.data.text.tokenizer import load  # noqa: E402
from launcher.errors import UserError  # noqa: E402

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": "3 plus 4 is 7."},
    {"role": "user", "content": "And 2 times 5?"},
    {"role": "assistant", "content": "2 times 5 is 10. Thank you!"},
]
ANSWERS = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    where = tmp_path_factory.mktemp("tokenizers")
    return {(layout, marked): tokenizer_folder(where, layout, marked) for layout in LAYOUTS for marked in (False, True)}


def jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def labelled_runs(tokenizer, sample):
    """The text of each run of labelled tokens, decoded."""
    runs, run = [], []
    for token, label in zip(sample["input_ids"], sample["labels"]):
        assert label in (-100, token)
        if label != -100:
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs + ([tokenizer.decode(run)] if run else [])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chat_labels_are_the_assistant_turns_with_their_end_of_turn_token(folders, tmp_path, layout):
    data = TextDataset(str(folders[layout, False]), jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    tokenizer, sample = data.tokenizer, data.samples[0]
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # the template's own rendering, tokenized whole
    assert sample["input_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert labelled_runs(tokenizer, sample) == [answer + END_OF_TURN[layout] for answer in ANSWERS]
    # and every other token is left out: together they are the rendering less the answers
    rest = tokenizer.decode([t for t, label in zip(sample["input_ids"], sample["labels"]) if label == -100])
    for answer in ANSWERS:
        rendered = rendered.replace(answer + END_OF_TURN[layout], "", 1)
    assert rest == rendered
    item = data[0]
    assert item["input_ids"].tolist() == sample["input_ids"] and item["labels"].tolist() == sample["labels"]
    assert item["attention_mask"].tolist() == [1] * len(sample["input_ids"])
    assert "its answers found by rendering each conversation's beginnings" in data.notes[0]


@pytest.mark.parametrize("spans", ["auto", "markers", "prefixes"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chat_labels_are_transformers_assistant_mask_of_a_template_with_generation_blocks(folders, layout, spans):
    tokenizer = load(str(folders[layout, True]))
    sample = Chat(tokenizer, {"messages": "messages"}, "answers", tokenizer.chat_template, spans)({"messages": CONVERSATION})
    theirs = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    assert sample["input_ids"] == theirs["input_ids"]
    assert [label != -100 for label in sample["labels"]] == [bool(m) for m in theirs["assistant_masks"]]
    assert sum(theirs["assistant_masks"]) > 10


def test_loss_on_all_trains_on_every_token(folders, tmp_path):
    data = TextDataset(str(folders["bpe", False]), jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]),
                       loss_on="all")
    assert data.samples[0]["labels"] == data.samples[0]["input_ids"]


def test_a_template_without_a_generation_prompt_still_leaves_the_role_header_out(folders, tmp_path):
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # ignores add_generation_prompt
    data = TextDataset(str(folders["bpe", False]), jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]),
                       chat_template=plain)
    # the content from its first token on (which holds the space after the header here), not the header
    assert labelled_runs(data.tokenizer, data.samples[0]) == [" " + answer for answer in ANSWERS]
    assert "the recipe's chat_template" in data.notes[0]


def test_a_template_that_renders_a_beginning_otherwise_is_one_line_naming_the_row(folders, tmp_path):
    # earlier answers shortened, the last one whole (as templates that drop earlier turns' reasoning do)
    hides = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}assistant: ...\n"
             "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}")
    path = jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(UserError) as e:
        TextDataset(str(folders["bpe", False]), path, chat_template=hides)
    assert str(e.value).startswith(f"{path}, line 1: the chat template renders its first 3 messages as a text that "
                                   f"is not how it renders the whole conversation") and "\n" not in str(e.value)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prompt_completion_trains_on_the_completion_and_eos(folders, tmp_path, layout):
    rows = [{"question": "What is 2 plus 2?", "answer": " 2 plus 2 is 4."}]
    data = TextDataset(str(folders[layout, False]), jsonl(tmp_path / "pc.jsonl", rows), format="prompt_completion",
                       columns={"prompt": "question", "completion": "answer"}, template="Q: {prompt}\nA:{completion}")
    tokenizer, sample = data.tokenizer, data.samples[0]
    text = "Q: What is 2 plus 2?\nA: 2 plus 2 is 4."
    # the whole text tokenized at once, with what the tokenizer adds itself (BOS for the BPE), then EOS
    assert sample["input_ids"] == tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert labelled_runs(tokenizer, sample) == [" 2 plus 2 is 4." + tokenizer.eos_token]


def test_a_prompt_completion_template_without_its_two_places_is_refused(folders, tmp_path):
    path = jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    for template in ("Q: {prompt}", "{completion} after {prompt}", "{prompt}{prompt}{completion}"):
        with pytest.raises(ValueError, match="a prompt_completion template holds {prompt} and then {completion}"):
            TextDataset(str(folders["bpe", False]), path, format="prompt_completion", template=template)


def test_text_documents_are_joined_with_eos_and_cut_into_rows_of_max_len(folders, tmp_path):
    documents = ["The quick brown fox jumps over the lazy dog.", "Hello, how are you today?", "", "What is 3 plus 4?"]
    data = TextDataset(str(folders["bpe", False]), jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in documents]),
                       format="text", max_len=8)
    tokenizer = data.tokenizer
    stream = [t for d in documents if d for t in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]]
    rows = [data[i]["input_ids"].tolist() for i in range(len(data))]
    assert [t for row in rows for t in row] == stream[:len(stream) - (len(stream) % 8 == 1)]
    assert all(len(row) == 8 for row in rows[:-1]) and 2 <= len(rows[-1]) <= 8
    assert all(data[i]["labels"].tolist() == rows[i] for i in range(len(data)))
    assert data.notes[1] == (f"{tmp_path / 'docs.jsonl'}: 3 documents as text -> joined with EOS into {len(rows)} rows "
                             f"of 8 tokens, {sum(map(len, rows))} tokens, every one a target")


def test_overlong_samples_are_truncated_or_dropped_and_counted(folders, tmp_path):
    long_answer = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two " * 40}]
    late_answer = [{"role": "user", "content": "Hello! " * 40}, {"role": "assistant", "content": "Hi."}]
    path = jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[:3]}, {"messages": long_answer},
                                           {"messages": late_answer}])
    folder = str(folders["bpe", False])
    cut = TextDataset(folder, path, max_len=60)
    assert len(cut) == 2 and max(len(s["input_ids"]) for s in cut.samples) == 60
    assert cut.notes[2] == ("2 of 3 samples longer than max_len 60 tokens: truncated at it (1 of them, left with no "
                            "answer token, dropped) (overlong: truncate)")
    dropped = TextDataset(folder, path, max_len=60, overlong="drop")
    assert len(dropped) == 1 and dropped.notes[2] == "2 of 3 samples longer than max_len 60 tokens: dropped (overlong: drop)"
    batch = Pad(values={"labels": -100})([cut[0], cut[1]])
    assert batch["input_ids"].shape == (2, 60) and (batch["labels"][0, len(cut.samples[0]["labels"]):] == -100).all()
    assert batch["attention_mask"].sum() == sum(len(s["input_ids"]) for s in cut.samples)


@pytest.mark.parametrize("arguments, says", [
    ({"format": "chatml"}, "format: 'chatml' is not one of chat, prompt_completion, text"),
    ({"loss_on": "answer"}, "loss_on: 'answer' is not one of answers, all"),
    ({"max_len": 1}, "max_len: 1: the most tokens a sample has, an integer of 2 or more"),
    ({"columns": {"prompt": "q"}}, "columns: 'prompt': format chat reads the columns messages"),
    ({"format": "text", "template": "{prompt}{completion}"}, "template: format text takes none"),
    ({"packing": "yes"}, "packing: 'yes': true or false"),
])
def test_a_wrong_argument_is_a_value_error_naming_it(folders, tmp_path, arguments, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        TextDataset(str(folders["bpe", False]), jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]),
                    **arguments)


def test_a_tokenizer_that_ends_a_text_with_eos_itself_gets_no_second_one_and_trains_on_it(folders):
    from tokenizers import processors

    from launcher.data.text.formats import PromptCompletion

    tokenizer = load(str(folders["bpe", False]))
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(  # as add_eos_token: true makes it
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    sample = PromptCompletion(tokenizer, {"prompt": "prompt", "completion": "completion"}, "answers")(
        {"prompt": "What is 2 plus 2?", "completion": " 4."})
    assert sample["input_ids"][-2:] != [1, 1] and sample["input_ids"][-1] == sample["labels"][-1] == 1
    assert labelled_runs(tokenizer, sample) == [" 4.</s>"]


def test_the_dataset_pickles_for_spawned_loader_workers(folders, tmp_path):
    import pickle

    data = TextDataset(str(folders["byte_level", False]), jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    again = pickle.loads(pickle.dumps(data))
    assert again.samples == data.samples and again[0]["labels"].tolist() == data[0]["labels"].tolist()


def test_packing_serves_rows_of_whole_samples_each_once(folders, tmp_path):
    from launcher.data.collate import Packed

    rows = [{"messages": CONVERSATION[:3 + 2 * (i % 2)]} for i in range(9)]
    data = TextDataset(str(folders["bpe", False]), jsonl(tmp_path / "chat.jsonl", rows), max_len=200, packing=True,
                       seed=3, batch_size=2)
    assert sorted(i for row in data.rows for i in row) == list(range(9)) and len(data) < 9
    for index, row in enumerate(data.rows):
        item = data[index]
        assert set(item) == {"input_ids", "labels", "position_ids", "document_ids"} and len(item["input_ids"]) <= 200
        assert item["input_ids"].tolist() == [t for i in row for t in data.samples[i]["input_ids"]]
        assert item["document_ids"].tolist() == [d for d, i in enumerate(row) for _ in data.samples[i]["input_ids"]]
    assert data.notes[-2].startswith(f"packing: 9 samples into {len(data)} rows of at most 200 tokens; padding in "
                                     f"batches of 2: ")
    again = TextDataset(str(folders["bpe", False]), jsonl(tmp_path / "chat.jsonl", rows), max_len=200, packing=True,
                        seed=3)
    assert again.rows == data.rows  # a function of the samples and the seed: the same on every rank
    batch = Packed()([data[0], data[1]])
    assert batch["document_ids"].shape == batch["input_ids"].shape
