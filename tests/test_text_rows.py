"""Rows that cost or teach what they should not (launcher/data/text/): a row of more characters than max_len's tokens
can use is refused before it is rendered (one line naming the file and row, counted under bad_rows: skip); files
that give no sample say why (overlong: drop dropped every one, truncation left no answer token); and a token the
model's input embedding has no row for (a tokenizer grown without resizing the model) is one line at start
naming the token and both sizes, exit 2, where it was an IndexError mid-run."""

import json

import pytest

from tests.conftest import REPO
from tests.text_folders import tokenizer_folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.text import TextDataset, TextStream  # noqa: E402
from launcher.data.text.formats import ROW_CHARACTERS  # noqa: E402
from launcher.errors import UserError  # noqa: E402

QUESTION = {"role": "user", "content": "What is 3 plus 4?"}
ANSWER = {"role": "assistant", "content": "3 plus 4 is 7."}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tokenizer_folder(tmp_path_factory.mktemp("rows")))


def jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def refused(*args, **settings) -> str:
    with pytest.raises(UserError) as e:
        TextDataset(*args, cache=None, **settings)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("format", ["chat", "prompt_completion"])
def test_a_row_longer_than_max_len_can_use_is_refused_before_it_is_rendered(folder, tmp_path, format):
    from launcher.data.text.conversation import characters

    max_len = 32
    if format == "chat":  # a row's characters: its strings', one more for each element (the messages, their keys)
        row = lambda n: {"messages": [QUESTION, {"role": "assistant", "content": "Hi! " * n}]}  # noqa: E731
        size = lambda n: characters([row(n)["messages"], None])  # noqa: E731 (None: the row has no tools)
    else:
        row = lambda n: {"prompt": "Hello?", "completion": " Hi!" * n}  # noqa: E731
        size = lambda n: 6 + 4 * n  # noqa: E731
    over = next(n for n in range(1000) if size(n) > ROW_CHARACTERS * max_len)  # 2,048 characters
    path = jsonl(tmp_path / "rows.jsonl", [row(1), row(over), row(over - 1)])
    assert refused(folder, path, format=format, max_len=max_len) == (
        f"{path}, line 2: {size(over):,} characters, more than a row of max_len 32 tokens may hold (64 characters a "
        f"token: 2,048): it would be rendered and tokenized whole to keep its first 32 tokens; split it, or raise "
        f"max_len (bad_rows: skip would skip such rows and count them)")
    skipped = TextDataset(folder, path, format=format, max_len=max_len, bad_rows="skip", cache=None)
    assert len(skipped) == 2 and skipped.notes[-2].startswith(f"1 malformed row skipped (bad_rows: skip); the "
                                                              f"first: {path}, line 2: {size(over):,} characters")


def test_a_row_of_50_mb_is_refused_without_rendering_it(folder, tmp_path):
    path = jsonl(tmp_path / "big.jsonl", [{"messages": [{"role": "user", "content": "a " * 25_000_000}, ANSWER]}])
    assert refused(folder, path, max_len=256).startswith(f"{path}, line 1: 50,000,0")


def test_files_that_give_no_sample_say_why(folder, tmp_path):
    late = [{"role": "user", "content": "Hello! " * 40}, ANSWER]  # its answer starts after token 60
    path = jsonl(tmp_path / "late.jsonl", [{"messages": late}] * 3)
    assert refused(folder, path, max_len=60) == (
        f"files: {path}: no samples in them: all 3 rows taken as chat are longer than max_len 60 tokens, and "
        f"truncated at it none keeps an answer token (their answers start after token 60); raise max_len, or give "
        f"rows whose answers come sooner")
    assert refused(folder, path, max_len=60, overlong="drop") == (
        f"files: {path}: no samples in them: all 3 rows taken as chat are longer than max_len 60 tokens, and "
        f"overlong: drop drops them; raise max_len, or give rows whose answers come sooner")
    bad = jsonl(tmp_path / "bad.jsonl", [{"messages": late}, {"messages": [QUESTION]}])
    assert refused(folder, bad, max_len=60, bad_rows="skip") == (
        f"files: {bad}: no samples in them: all 1 rows taken as chat are longer than max_len 60 tokens, and "
        f"truncated at it none keeps an answer token (their answers start after token 60); 1 skipped as malformed "
        f"(bad_rows: skip), the first: {bad}, line 2: no assistant message, so nothing to learn from it (loss_on: "
        f"answers trains on the assistant's messages); raise max_len, or give rows whose answers come sooner")


@pytest.fixture()
def grown(tmp_path):
    """A model folder whose tokenizer has 8 tokens added (249 + 8 = 257) and whose embedding has 256 rows, and
    a file in which the last of them (id 256) appears in the 10th row of 12."""
    from transformers import PreTrainedTokenizerFast

    from recipes.components.hf_folder import write

    model = tmp_path / "model"
    write(str(model))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model))
    tokenizer.add_tokens([f"<tool_{i}>" for i in range(8)])
    tokenizer.save_pretrained(str(model))
    rows = [{"messages": [QUESTION, ANSWER]}] * 12
    rows[9] = {"messages": [QUESTION, {"role": "assistant", "content": "<tool_7> 3 plus 4 is 7."}]}
    return model, jsonl(tmp_path / "chat.jsonl", rows)


def test_a_token_the_models_embedding_has_no_row_for_is_one_line_at_start(grown, tmp_path, capsys):
    from launcher.cli import main

    model, path = grown
    code = main([str(REPO / "recipes" / "hf_sft.yaml"), f"model.config.pretrained_model_name_or_path={model}",
                 f"data.train.files={path}", f"run_dir={tmp_path / 'run'}", "on_cpu=null", "precision=fp32",
                 "logging.tensorboard=false", "logging.progress_bar=false", "data.batch_size=4",
                 "trainer.max_steps=3", "data.train.cache=null", "logging.memory_plan=false"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err == (f"launcher: data.train: token 256 ('<tool_7>') of the tokenizer (257 tokens) is in the samples, and "
                   f"the model's input embedding has 256 rows (ids 0 to 255): a tokenizer grown by added tokens needs "
                   f"the model's embedding resized to it (model.resize_token_embeddings(257), then saved), or the "
                   f"model folder whose tokenizer it is\n")


def test_a_stream_says_the_row_of_a_token_beyond_the_embedding_as_it_meets_it(grown):
    model, path = grown
    stream = TextStream(str(model), path, max_len=64)
    stream.check_vocabulary(256)
    items = iter(stream)
    for _ in range(9):
        next(items)
    with pytest.raises(UserError) as e:
        next(items)
    assert str(e.value).startswith(f"{path}, line 10: token 256 ('<tool_7>') of the tokenizer (257 tokens) is in the "
                                   f"samples, and the model's input embedding has 256 rows")


def test_a_row_of_many_messages_is_refused_where_its_answers_are_found_by_prefixes(folder, tmp_path):
    """Prefixes render each answer's beginning: time that grows with the square of the messages. A row of 4,000
    short messages (within max_len 2048's characters) took minutes a row before; it is one line now, and a
    template with {% generation %} markers renders it once."""
    from launcher.data.text.chat import MAX_PREFIXED
    from launcher.data.text.conversation import characters
    from tests.text_folders import MARKED

    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(4000)]
    assert characters([many, None]) < ROW_CHARACTERS * 2048  # not the row's characters: its messages
    path = jsonl(tmp_path / "many.jsonl", [{"messages": [QUESTION, ANSWER]}, {"messages": many},
                                           {"messages": many[:MAX_PREFIXED]}])
    assert refused(folder, path) == (
        f"{path}, line 2: 4,000 messages, more than the {MAX_PREFIXED} a row may have where the answers are found by "
        f"rendering each conversation's beginning (a rendering for each answer: time that grows with the square of "
        f"the messages); split the conversation, or give the chat template {{% generation %}} markers (one "
        f"rendering a row) (bad_rows: skip would skip such rows and count them)")
    assert len(TextDataset(folder, path, bad_rows="skip", cache=None)) == 2  # 256 messages are taken
    marked = tokenizer_folder(tmp_path, template=MARKED["bpe"])
    samples = TextDataset(str(marked), path, max_len=2048, cache=None).samples
    assert len(samples) == 3 and len(samples[1]["input_ids"]) == 2048  # truncated at max_len, as rows are
