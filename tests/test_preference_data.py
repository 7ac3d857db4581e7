"""Preference data (launcher/data/text/pairs.py, preference.py, collate.Pairs): rows of prompt, chosen and
rejected, as strings or conversations, made into pairs whose labels are on the answer alone (never on the
prompt, nor on its own assistant turns); max_len per sequence, truncated or dropped and counted; bad rows one
line; packed rows of whole pairs whose collated sequence_ids give the padded batch's sequences; the
reference's values carried and padded; the cache's items the same as tokenized ones."""

import json

import pytest
import torch

from tests.conftest import REPO
from tests.test_text_formats import labelled_runs
from tests.text_folders import END_OF_TURN, LAYOUTS, tokenizer_folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.collate import Pairs  # noqa: E402
from launcher.data.text import TextDataset, TextStream  # noqa: E402
from launcher.errors import UserError  # noqa: E402

PAIRS = REPO / "recipes" / "data" / "pairs.jsonl"
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 4?"},
          {"role": "assistant", "content": "3 plus 4 is 7."}, {"role": "user", "content": "And 2 times 5?"}]
CHOSEN = [{"role": "assistant", "content": "2 times 5 is 10."}]
REJECTED = [{"role": "assistant", "content": "2 times 5 is 12. Thank you!"}]
# what an answer is scored to: its end of turn and what the template writes after it (ChatML's newline), as TRL's
# DPOTrainer scores what follows the prompt
TURN_END = {layout: END_OF_TURN[layout] + {"bpe": "\n", "byte_level": ""}[layout] for layout in LAYOUTS}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    where = tmp_path_factory.mktemp("tokenizers")
    return {(layout, marked): tokenizer_folder(where, layout, marked) for layout in LAYOUTS for marked in (False, True)}


@pytest.fixture(scope="module")
def bpe(folders):
    return str(folders["bpe", False])


def jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def targets(tokenizer, ids, labels):
    """The text of the labelled tokens, each run decoded (labels are the tokens or -100)."""
    return labelled_runs(tokenizer, {"input_ids": ids.tolist(), "labels": labels.tolist()})


def preference(folder, files, **settings):
    return TextDataset(folder, files, format="preference", **{"max_len": 128, "cache": None, **settings})


@pytest.mark.parametrize("marked", (False, True), ids=("prefixes", "markers"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_conversation_pair_is_trained_on_its_answer_alone_not_the_prompts_own_answers(folders, tmp_path, layout,
                                                                                        marked):
    data = preference(str(folders[layout, marked]), jsonl(tmp_path / "p.jsonl", [
        {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}]))
    item, tokenizer = data[0], data.tokenizer
    assert len(data) == data.pairs() == 1 and set(item) == {"chosen_input_ids", "chosen_labels", "rejected_input_ids",
                                                            "rejected_labels"}
    for side, answer in (("chosen", CHOSEN), ("rejected", REJECTED)):
        rendered = tokenizer.apply_chat_template(PROMPT + answer, tokenize=False)
        assert item[f"{side}_input_ids"].tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert targets(tokenizer, item[f"{side}_input_ids"], item[f"{side}_labels"]) == \
            [answer[0]["content"] + TURN_END[layout]]
        assert item[f"{side}_labels"].dtype == torch.long
    pair = data.pair_item(0)
    assert all(torch.equal(pair[key], item[key]) for key in item)


@pytest.mark.parametrize("marked", (False, True), ids=("prefixes", "markers"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_conversation_pair_scores_the_tokens_trl_s_dpo_trainer_scores(folders, tmp_path, layout, marked):
    """The same tokens, and the loss on the same ones: what follows the prompt to the text's end (ChatML's newline
    after <|im_end|> too), so that logps/chosen and the loss are TRL's."""
    pytest.importorskip("trl", reason="the trl extra is not installed")
    from launcher.bench.dpo.peer import tokenized

    folder = str(folders[layout, marked])
    files = jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},
                                         {"prompt": PROMPT[-1:], "chosen": REJECTED, "rejected": CHOSEN}])
    ours = preference(folder, files)
    for k, pair in enumerate(tokenized(folder, files, 128)):
        item = ours.pair_item(k)
        for side in ("chosen", "rejected"):
            answer = pair[f"{side}_ids"]
            assert item[f"{side}_input_ids"].tolist() == pair["prompt_ids"] + answer
            assert item[f"{side}_labels"].tolist() == [-100] * len(pair["prompt_ids"]) + answer


def test_a_pair_of_strings_is_the_prompts_completion_twice(bpe, tmp_path):
    template = "Q: {prompt}\nA:{completion}"
    rows = [{"prompt": "What is 2 plus 2?", "chosen": " 4.", "rejected": " 5, I think."}]
    data = preference(bpe, jsonl(tmp_path / "p.jsonl", rows), template=template)
    sft = TextDataset(bpe, jsonl(tmp_path / "c.jsonl", [{"prompt": rows[0]["prompt"], "completion": rows[0][side]}
                                                         for side in ("chosen", "rejected")]),
                      format="prompt_completion", template=template, cache=None)
    item = data[0]
    for k, side in enumerate(("chosen", "rejected")):
        assert item[f"{side}_input_ids"].tolist() == sft.samples[k]["input_ids"]
        assert item[f"{side}_labels"].tolist() == sft.samples[k]["labels"]
        assert targets(data.tokenizer, item[f"{side}_input_ids"], item[f"{side}_labels"]) == [rows[0][side] + "</s>"]


def test_without_a_prompt_column_the_prompt_is_what_both_answers_begin_with_as_trl_takes_it(bpe, tmp_path):
    explicit = preference(bpe, jsonl(tmp_path / "e.jsonl", [
        {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},
        {"prompt": "What is 2 plus 2?", "chosen": " It is 4.", "rejected": " It is 5."}]))
    implicit = preference(bpe, jsonl(tmp_path / "i.jsonl", [
        {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED},
        {"chosen": "What is 2 plus 2? It is 4.", "rejected": "What is 2 plus 2? It is 5."}]))
    assert implicit.samples[:2] == explicit.samples[:2]  # the conversation's
    # strings: the prompt is what they share less the space where they part (" It is " is shared too)
    said = targets(implicit.tokenizer, implicit[1]["chosen_input_ids"], implicit[1]["chosen_labels"])
    assert said == [" 4.</s>"]


def test_pairs_over_max_len_are_truncated_or_dropped_and_counted(bpe, tmp_path):
    long_prompt = [{"role": "user", "content": "What is 3 plus 4? " * 12}]
    rows = [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},
            {"prompt": PROMPT[-1:], "chosen": CHOSEN, "rejected": [{"role": "assistant", "content": "No. " * 40}]},
            {"prompt": long_prompt, "chosen": CHOSEN, "rejected": REJECTED}]  # its answers start past max_len
    files = jsonl(tmp_path / "p.jsonl", rows)
    lengths = [[len(s["input_ids"]) for s in pair] for pair in zip(*[iter(preference(bpe, files).samples)] * 2)]
    max_len = max(lengths[0]) + 1
    assert max(lengths[1]) > max_len and min(lengths[1]) < max_len

    cut = preference(bpe, files, max_len=max_len)
    assert cut.pairs() == 2 and len(cut[1]["rejected_input_ids"]) == max_len
    assert len(cut[1]["chosen_input_ids"]) == lengths[1][0]  # max_len is each sequence's
    assert f"2 of 3 pairs with a sequence (prompt + chosen, prompt + rejected) longer than max_len {max_len} " \
           f"tokens: truncated at it (1 of them, left with no answer token on a side, dropped) (overlong: " \
           f"truncate)" in cut.notes
    assert any(line.startswith(f"{files}: 3 rows as preference -> 2 pairs, chosen of ") for line in cut.notes)

    dropped = preference(bpe, files, max_len=max_len, overlong="drop")
    assert dropped.pairs() == 1 and dropped.samples == cut.samples[:2]
    assert any("2 of 3 pairs with a sequence" in line and line.endswith("dropped (overlong: drop)")
               for line in dropped.notes)


@pytest.mark.parametrize("row, said", [
    ({"prompt": "Hi", "chosen": "Hello"}, "no column 'rejected'; a preference row holds prompt, chosen and rejected"),
    ({"prompt": "Hi", "chosen": CHOSEN, "rejected": REJECTED}, "column 'chosen' holds a list and column 'prompt' a "
                                                              "string; a pair is of strings, or of conversations"),
    ({"prompt": PROMPT, "chosen": [{"role": "user", "content": "?"}], "rejected": REJECTED},
     "column 'chosen' holds no assistant message"),
    ({"prompt": [{"role": "bot", "content": "?"}], "chosen": CHOSEN, "rejected": REJECTED},
     "'prompt' then 'chosen' (messages 1 to 1 the prompt's): message 1 has the role 'bot'"),
    ({"prompt": "Hi", "chosen": "", "rejected": "No"}, "column 'chosen' holds str ''; an answer is a non-empty"),
    ({"prompt": PROMPT, "chosen": [{"role": "assistant", "content": ""}], "rejected": REJECTED},
     "column 'chosen': message 1 is the assistant's with nothing in it"),
    ({"prompt": PROMPT, "chosen": CHOSEN,
      "rejected": [{"role": "assistant", "content": [{"type": "text", "text": " "}]}]},
     "column 'rejected': message 1 is the assistant's with nothing in it"),
])
def test_a_bad_row_is_one_line_naming_its_file_and_row_or_skipped_and_counted(bpe, tmp_path, row, said):
    good = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}
    files = jsonl(tmp_path / "p.jsonl", [good, row, good])
    with pytest.raises(UserError) as e:
        preference(bpe, files)
    assert str(e.value).startswith(f"{files}, line 2: {said}") and "\n" not in str(e.value)
    skipped = preference(bpe, files, bad_rows="skip")
    assert skipped.pairs() == 2
    assert f"1 malformed row skipped (bad_rows: skip); the first: {files}, line 2: {said}" in "\n".join(skipped.notes)


def test_a_conversation_without_a_chat_template_is_one_line_and_strings_need_none(folders, tmp_path):
    folder = tokenizer_folder(tmp_path, "bpe", template="")
    row = {"prompt": "Hi", "chosen": " yes", "rejected": " no"}
    strings = preference(str(folder), jsonl(tmp_path / "s.jsonl", [row]))
    assert strings.pairs() == 1 and "no chat template: pairs of strings only" in strings.notes[0]
    files = jsonl(tmp_path / "c.jsonl", [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}])
    with pytest.raises(UserError, match=r"c.jsonl, line 1: a conversation, and the tokenizer has no chat template"):
        preference(str(folder), files, bad_rows="skip")


def test_packed_rows_hold_whole_pairs_and_their_sequence_ids_give_the_padded_batchs_sequences(bpe):
    padded = preference(bpe, str(PAIRS))
    packed = preference(bpe, str(PAIRS), packing=True, seed=3)
    assert len(packed) < padded.pairs() and sorted(k for row in packed.rows for k in row) == list(range(padded.pairs()))
    for index in range(len(packed)):
        row = packed[index]
        assert len(row["input_ids"]) <= 2 * 128
        assert int(row["document_ids"].max()) + 1 == 2 * len(packed.rows[index])
    # a batch of three packed rows against the same pairs, in the same order, unpacked
    order = [k for index in range(3) for k in packed.rows[index]]
    batch = Pairs(pad_id=7)([packed[index] for index in range(3)])
    plain = Pairs(pad_id=7)([padded[k] for k in order])
    assert set(plain) == {"input_ids", "labels", "attention_mask", "sequence_ids"}
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids", "sequence_ids"}
    assert plain["input_ids"].shape[0] == 2 * len(order) and int(batch["sequence_ids"].max()) == 2 * len(order) - 1
    for s in range(2 * len(order)):
        mine, theirs = batch["sequence_ids"] == s, plain["sequence_ids"] == s
        assert torch.equal(theirs.nonzero()[:, 0], torch.full((int(theirs.sum()),), s))  # unpacked: row s
        assert torch.equal(batch["input_ids"][mine], plain["input_ids"][theirs])
        assert torch.equal(batch["position_ids"][mine], torch.arange(int(mine.sum())))
        # packed, a document's first label is -100; unpacked it is never scored (nothing comes before it)
        assert torch.equal(batch["labels"][mine][1:], plain["labels"][theirs][1:])
        side = ("chosen", "rejected")[s % 2]
        assert torch.equal(plain["input_ids"][theirs], padded.pair_item(order[s // 2])[f"{side}_input_ids"])
    pads = plain["sequence_ids"] == -1
    assert torch.equal(pads, plain["attention_mask"] == 0) and (plain["input_ids"][pads] == 7).all()
    assert (plain["labels"][pads] == -100).all() and (batch["document_ids"][batch["sequence_ids"] == -1] == -1).all()


def test_the_reference_values_are_carried_padded_and_checked(bpe):
    data = preference(bpe, str(PAIRS))
    packed = preference(bpe, str(PAIRS), packing=True)
    values = []
    for k in range(data.pairs()):
        pair = data.pair_item(k)
        values.append(tuple(torch.where(pair[f"{side}_labels"] == -100, 0.0,
                                        -torch.arange(len(pair[f"{side}_labels"]), dtype=torch.float64) - k / 7)
                            for side in ("chosen", "rejected")))
    for dataset in (data, packed):
        dataset.attach_reference(values)
    item = data[5]
    assert item["chosen_ref_logps"].dtype == torch.float64 and torch.equal(item["rejected_ref_logps"], values[5][1])
    assert torch.equal(data.pair_item(5)["chosen_ref_logps"], values[5][0])
    batch = Pairs()([data[0], data[1]])
    assert batch["ref_logps"].dtype == torch.float64 and batch["ref_logps"].shape == batch["input_ids"].shape
    for s in range(4):
        assert torch.equal(batch["ref_logps"][s][batch["sequence_ids"][s] == s], values[s // 2][s % 2])
    assert (batch["ref_logps"][batch["sequence_ids"] == -1] == 0.0).all()
    rows = Pairs()([packed[0], packed[1]])
    order = packed.rows[0] + packed.rows[1]
    for s in range(2 * len(order)):
        assert torch.equal(rows["ref_logps"][rows["sequence_ids"] == s], values[order[s // 2]][s % 2])
    assert (rows["ref_logps"][rows["sequence_ids"] == -1] == 0.0).all()
    with pytest.raises(ValueError, match="pair 3's rejected has"):
        data.attach_reference(values[:3] + [(values[3][0], values[3][1][:-1])] + values[4:])
    with pytest.raises(ValueError, match="values for"):
        data.attach_reference(values[:-1])


def test_the_cache_gives_the_same_items_and_the_reference_key_follows_the_tokens(bpe, tmp_path):
    files = tmp_path / "pairs.jsonl"
    files.write_text(PAIRS.read_text())
    made = preference(bpe, str(files), cache=str(tmp_path / "cache"))
    hit = preference(bpe, str(files), cache=str(tmp_path / "cache"))
    plain = preference(bpe, str(files))
    assert made.notes[-1].startswith("tokenized 40 rows, cached at") and hit.notes[-1].startswith("cache: hit")
    assert made.notes[:-1] == hit.notes[:-1] and hit.pairs() == made.pairs() == 40
    for k in range(made.pairs()):
        assert all(torch.equal(hit[k][key], made[k][key]) for key in made[k])
    assert made.reference_key() == hit.reference_key() == plain.reference_key()
    assert preference(bpe, str(files), max_len=64).reference_key() != plain.reference_key()
    files.write_text(PAIRS.read_text().replace("is 12.", "is 13.", 1))
    assert preference(bpe, str(files)).reference_key() != plain.reference_key()


def test_the_shipped_pairs_train_their_answers_and_a_stream_gives_the_datasets_items(bpe):
    data = preference(bpe, str(PAIRS))
    assert data.pairs() == 40 and all("truncated" not in line for line in data.notes)
    multi = [k for k, line in enumerate(PAIRS.read_text().splitlines())
             if sum(m["role"] == "assistant" for m in json.loads(line)["prompt"])]
    assert multi  # some prompts hold an earlier answer, which is never a target
    for k in multi:
        for side in ("chosen", "rejected"):
            said = targets(data.tokenizer, data[k][f"{side}_input_ids"], data[k][f"{side}_labels"])
            assert said == [json.loads(PAIRS.read_text().splitlines()[k])[side][0]["content"] + TURN_END["bpe"]]
    stream = list(TextStream(bpe, str(PAIRS), format="preference", max_len=128))
    assert len(stream) == 40 and all(torch.equal(stream[k][key], data[k][key]) for k in range(40) for key in data[k])
    packed = preference(bpe, str(PAIRS), packing=True, seed=5)
    rows = list(TextStream(bpe, str(PAIRS), format="preference", max_len=128, packing=True, seed=5))
    assert len(rows) == len(packed) and all(torch.equal(rows[i][key], packed[i][key])
                                            for i in range(len(rows)) for key in rows[i])


def test_other_formats_have_no_pairs_and_preference_scores_the_answers_alone(bpe, tmp_path):
    chat = TextDataset(bpe, str(REPO / "recipes" / "data" / "chat.jsonl"), max_len=64, cache=None)
    with pytest.raises(TypeError, match=r"pairs\(\): a dataset of format preference's; this one's format is chat"):
        chat.pairs()
    with pytest.raises(ValueError, match="format preference scores the answers alone"):
        preference(bpe, str(PAIRS), loss_on="all")


def test_what_a_conversations_row_holds_that_no_sample_shows_is_said(bpe, tmp_path):
    rows = [{"id": 1, "prompt": PROMPT, "chosen": [{**CHOSEN[0], "thinking": "10"}], "rejected": REJECTED},
            {"id": 2, "prompt": "Hi", "chosen": " yes", "rejected": " no"}]
    data = preference(bpe, jsonl(tmp_path / "p.jsonl", rows))
    assert "rows hold what the chat template never reads, so that no sample shows it: column 'id', messages' " \
           "'thinking'" in data.notes


@pytest.mark.slow  # two spawned processes, each importing torch and transformers
def test_pairs_made_in_processes_are_the_pairs_made_in_one(bpe):
    one = preference(bpe, str(PAIRS), max_len=48)
    two = preference(bpe, str(PAIRS), max_len=48, num_proc=2)
    assert two.samples == one.samples and two.notes == one.notes
