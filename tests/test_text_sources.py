"""Rows of local files (launcher/data/text/sources.py) and malformed ones: each kind of file gives the same
rows; a glob is read in sorted order; a row that is not JSON, not UTF-8, lacks its column, holds a wrong type,
a wrong role or an empty conversation is one line naming the file and the row, or skipped and counted
(bad_rows: skip)."""

import json

import pytest

from tests.text_folders import tokenizer_folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.text import TextDataset, sources  # noqa: E402
from launcher.errors import UserError  # noqa: E402

ROWS = [{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                      {"role": "assistant", "content": f"{i} plus 1 is {i + 1}."}]} for i in range(3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tokenizer_folder(tmp_path_factory.mktemp("tokenizer")))


def lines(path, *texts: bytes):
    path.write_bytes(b"".join(t + b"\n" for t in texts))
    return str(path)


def values(files, **kwargs):
    got = list(sources.rows(files, **kwargs))
    assert all(row.problem is None for row in got), got
    return [row.value for row in got]


def test_every_kind_of_file_gives_the_same_rows(tmp_path):
    import datasets
    import pyarrow
    import pyarrow.parquet

    lines(tmp_path / "a.jsonl", *(json.dumps(r).encode() for r in ROWS))
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    for files in ("a.jsonl", "a.json", "a.parquet", "saved"):
        assert values(str(tmp_path / files)) == ROWS, files
    assert values(str(tmp_path / "dict"), split="validation") == ROWS
    with pytest.raises(UserError, match=f"split: 'train' is not a split of {tmp_path / 'dict'}; it has validation"):
        values(str(tmp_path / "dict"))


def test_csv_and_plain_text(tmp_path):
    (tmp_path / "a.csv").write_text('\ufeffprompt,completion\n"Say ""hi""",hi\n"two\nlines",ok\n')  # a BOM first
    assert values(str(tmp_path / "a.csv")) == [{"prompt": 'Say "hi"', "completion": "hi"},
                                               {"prompt": "two\nlines", "completion": "ok"}]
    (tmp_path / "b.txt").write_text("First line.\n\nSecond line.\n")
    assert values(str(tmp_path / "b.txt")) == [{"text": "First line.\n\nSecond line.\n"}]
    assert values(str(tmp_path / "b.txt"), text_rows="line") == [{"text": "First line."}, {"text": "Second line."}]


def test_a_json_file_of_one_object_over_several_lines_is_one_line(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"data": ROWS}, indent=2))
    with pytest.raises(UserError) as e:
        list(sources.rows(str(tmp_path / "a.json")))
    assert str(e.value) == (f"{tmp_path / 'a.json'}: one JSON object over several lines; a .json file holds an array "
                            f"of row objects, or one object per line")
    (tmp_path / "b.json").write_text("".join(json.dumps(row) + "\n" for row in ROWS))  # JSON Lines named .json
    assert values(str(tmp_path / "b.json")) == ROWS


def test_a_glob_is_read_in_sorted_order_and_a_list_in_its_own(tmp_path):
    for name in ("b", "a", "c"):
        lines(tmp_path / f"{name}.jsonl", json.dumps({"text": name}).encode())
    assert values(str(tmp_path / "*.jsonl")) == [{"text": "a"}, {"text": "b"}, {"text": "c"}]
    assert values([str(tmp_path / "c.jsonl"), str(tmp_path / "[ab].jsonl")]) == [{"text": t} for t in "cab"]


@pytest.mark.parametrize("files, says", [
    ("nothing/*.jsonl", "files: 'nothing/*.jsonl' matches no file"),
    ("missing.jsonl", "files: missing.jsonl: no such file"),
    ("pyproject.toml", "files: pyproject.toml: reads files ending in .jsonl, .ndjson, .json, .csv, .parquet, .txt, "
                       ".text, .md, or a folder written by datasets' save_to_disk"),
    ("recipes", "files: recipes: a folder, and not a dataset written by save_to_disk; name its files "
                "(recipes/*.jsonl)"),
])
def test_files_that_are_not_there_are_one_line(files, says):
    with pytest.raises(UserError) as e:
        list(sources.rows(files))
    assert str(e.value) == says


GOOD = json.dumps(ROWS[0]).encode()
CONVERSATION = ROWS[0]["messages"]


@pytest.mark.parametrize("name, second, says", [
    ("not-json", b'{"messages": [', "not JSON (Expecting value at column 15)"),
    ("not-utf8", b'{"messages": "\xff"}', "not UTF-8 (byte 0xff at column 15)"),
    ("not-an-object", b"[1, 2]", "holds a list; a row is a JSON object of columns"),
    ("missing-column", json.dumps({"conversation": CONVERSATION}).encode(),
     "no column 'messages' (the conversation (a list of {role, content} messages)); it has 'conversation'"),
    ("wrong-type", b'{"messages": "hi"}', "column 'messages' holds str 'hi'; the conversation (a list of {role, "
                                          "content} messages) is a list"),
    ("wrong-role", json.dumps({"messages": [CONVERSATION[0], {"role": "bot", "content": "hi"}]}).encode(),
     "message 2 has the role 'bot'; a role is one of system, user, assistant, tool"),
    ("no-content", json.dumps({"messages": [CONVERSATION[0], {"role": "assistant", "content": None}]}).encode(),
     "message 2 (assistant) has no content; a content is a string (or a list of text parts), and an assistant's "
     "may be left out where it holds tool_calls"),
    ("empty", b'{"messages": []}', "an empty conversation; a chat row holds a list of {role, content} messages, an "
                                   "assistant's among them"),
    ("no-answer", json.dumps({"messages": CONVERSATION[:1]}).encode(),
     "no assistant message, so nothing to learn from it (loss_on: answers trains on the assistant's messages)"),
])
def test_a_malformed_row_is_one_line_naming_the_file_and_row_or_is_skipped_and_counted(folder, tmp_path, name,
                                                                                        second, says):
    path = lines(tmp_path / f"{name}.jsonl", GOOD, second, GOOD)
    with pytest.raises(UserError) as e:
        TextDataset(folder, path)
    assert str(e.value) == f"{path}, line 2: {says} (bad_rows: skip would skip such rows and count them)"
    skipped = TextDataset(folder, path, bad_rows="skip")
    assert len(skipped) == 2 and skipped.notes[-2] == (f"1 malformed row skipped (bad_rows: skip); the first: "
                                                       f"{path}, line 2: {says}")


def test_malformed_csv_and_text_rows_name_their_row_and_line(folder, tmp_path):
    csv = tmp_path / "pc.csv"
    csv.write_bytes(b'prompt,completion\nWhat is 1 plus 1?,2\n"multi\nline \xfe",3\nonly one field\n')
    with pytest.raises(UserError, match=f"^{csv}, row 2: not UTF-8 \\(byte 0xfe at column 6\\)"):
        TextDataset(folder, str(csv), format="prompt_completion")
    skipped = TextDataset(folder, str(csv), format="prompt_completion", bad_rows="skip")
    assert len(skipped) == 1 and skipped.notes[-2].startswith("2 malformed rows skipped (bad_rows: skip); the first: ")
    text = tmp_path / "doc.txt"
    text.write_bytes(b"One.\nTwo.\nThree \xc3(.\n")
    with pytest.raises(UserError, match=f"^{text}, line 3: not UTF-8 \\(byte 0xc3\\)"):
        TextDataset(folder, str(text), format="text")


def test_keys_a_columnar_file_fills_with_none_are_dropped_before_the_template_sees_them(folder, tmp_path):
    import pyarrow
    import pyarrow.parquet

    named = [{"role": "user", "content": "Hi.", "name": "Ann"}, {"role": "assistant", "content": "Hello."}]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"messages": named}]), tmp_path / "a.parquet")
    assert values(str(tmp_path / "a.parquet"))[0]["messages"][1]["name"] is None  # Arrow gives every message a name
    template = ("{% for m in messages %}{% if m.name is defined %}{{ m.name }}: {% endif %}{{ m.role }}: "
                "{{ m.content }}\n{% endfor %}")
    data = TextDataset(folder, str(tmp_path / "a.parquet"), chat_template=template)
    assert data.tokenizer.decode(data.samples[0]["input_ids"]) == "Ann: user: Hi.\nassistant: Hello.\n"
