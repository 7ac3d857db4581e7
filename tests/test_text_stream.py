"""TextStream (launcher/data/text/streamed.py): TextDataset's samples in its order for chat, prompt_completion and
text, and its packed rows where one buffer holds every sample; read as they come (a few rows read for a few
samples, rows before a resume's place never tokenized); resumed from its state after any item as the pass
that went through, packed too; recipes/hf_sft.yaml streaming trains the weights of TextDataset's unshuffled
samples, resumes mid-epoch bitwise (packed too), says a bad row met mid-run in one line (from a loader worker
too), and under ddp x2 ends as one process."""

import json
import re

import pytest
import torch

from tests.conftest import REPO, state_dict
from tests.rounding import assert_within_rounding, float64
from tests.text_folders import tokenizer_folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.text import TextDataset, TextStream  # noqa: E402
from launcher.data.text import streamed  # noqa: E402
from launcher.errors import UserError  # noqa: E402

CHAT = REPO / "recipes" / "data" / "chat.jsonl"
RECIPE = REPO / "recipes" / "hf_sft.yaml"
STREAM = "data.train._target_=launcher.data.text.TextStream"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tokenizer_folder(tmp_path_factory.mktemp("tokenizers"), "bpe"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A file of each format: 30 conversations, 30 prompts and completions (a bad row among them), 12 documents."""
    where = tmp_path_factory.mktemp("stream-data")
    (where / "chat.jsonl").write_text("\n".join(CHAT.read_text().splitlines()[:30]) + "\n")
    pairs = [{"prompt": f"What is {i} plus {i}?", "completion": f" It is {2 * i}." + " Indeed." * (i % 5)}
             for i in range(30)]
    pairs[7] = {"prompt": "no completion"}
    (where / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in pairs))
    documents = [{"text": " ".join(f"word{j}" for j in range(i * 3 + 1))} for i in range(12)]
    (where / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in documents))
    return where


FORMATS = {
    "chat": dict(file="chat.jsonl", format="chat", max_len=64),
    "prompt_completion": dict(file="pairs.jsonl", format="prompt_completion", max_len=24, bad_rows="skip",
                              template="Q: {prompt}\nA:{completion}"),
    "prompt_completion-drop": dict(file="pairs.jsonl", format="prompt_completion", max_len=24, bad_rows="skip",
                                   overlong="drop", loss_on="all"),
    "text": dict(file="docs.jsonl", format="text", max_len=16),  # rows cut across documents, and inside them
}


def both(folder, files, case, **extra):
    """(TextDataset, TextStream) of one case's arguments (and the stream's `extra`)."""
    kwargs = dict(FORMATS[case])
    path = str(files / kwargs.pop("file"))
    stream_only = {key: extra.pop(key) for key in list(extra) if key == "packing_buffer"}
    return TextDataset(folder, path, **kwargs, **extra), TextStream(folder, path, **kwargs, **extra, **stream_only)


def assert_same_items(got, expected):
    assert len(got) == len(expected)
    for i, (one, other) in enumerate(zip(got, expected)):
        assert one.keys() == other.keys(), i
        for key in one:
            assert torch.equal(one[key], other[key]), f"item {i}: {key} differs"


@pytest.mark.parametrize("case", list(FORMATS))
def test_the_stream_gives_the_dataset_samples_in_its_order(folder, files, case):
    dataset, stream = both(folder, files, case)
    assert_same_items(list(stream), [dataset[i] for i in range(len(dataset))])
    assert_same_items(list(stream), [dataset[i] for i in range(len(dataset))])  # each pass from the start
    if case.startswith("prompt_completion"):
        assert stream.counts.skipped == 1 and "line 8" in stream.counts.first


@pytest.mark.parametrize("case", ["chat", "prompt_completion"])
def test_packed_with_every_sample_in_one_buffer_the_stream_gives_the_dataset_packed_rows(folder, files, case):
    dataset, stream = both(folder, files, case, packing=True, seed=3)
    rows = list(stream)
    assert len(rows) < 30 and set(rows[0]) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert_same_items(rows, [dataset[i] for i in range(len(dataset))])


def test_packed_in_buffers_each_row_holds_samples_of_one_buffer_and_every_sample_is_in_one(folder, files):
    _, stream = both(folder, files, "chat", packing=True, packing_buffer=7)
    unpacked = [sample["input_ids"].tolist() for sample in both(folder, files, "chat")[1]]
    buffers = {}
    for row in stream:
        at = stream.state_dict()
        buffer = at["buffer"] - (at["given"] == 0)  # a buffer's last row leaves the place at the next
        ids, documents = row["input_ids"].tolist(), row["document_ids"].tolist()
        for document in sorted(set(documents)):
            buffers.setdefault(buffer, []).append([t for t, d in zip(ids, documents) if d == document])
    assert sorted(buffers) == [0, 1, 2, 3, 4]
    for k, samples in buffers.items():
        assert sorted(samples) == sorted(unpacked[7 * k:7 * (k + 1)]), f"buffer {k}"


@pytest.mark.parametrize("case, extra", [("chat", {}), ("text", {}),
                                         ("chat", {"packing": True, "packing_buffer": 7})],
                         ids=["chat", "text", "chat-packed"])
def test_a_stream_resumed_from_its_state_after_any_item_gives_the_rest(folder, files, case, extra):
    _, stream = both(folder, files, case, **extra)
    whole = list(stream)
    for taken in range(len(whole)):
        reading = iter(stream)
        for _ in range(taken + 1):
            next(reading)
        state = stream.state_dict()
        _, resumed = both(folder, files, case, **extra)
        resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint keeps it
        assert_same_items(list(resumed), whole[taken + 1:])
    assert len(list(stream)) == len(whole)  # the pass after a resumed one starts from the start


def test_taking_samples_reads_only_their_rows_and_a_resume_tokenizes_none_before_its_place(folder, files, tmp_path,
                                                                                           monkeypatch):
    """A file of 20,000 conversations: three samples read three rows; resumed at row 15,000, one sample is one
    row made into a sample (the rows before are passed over unread by the format: no tokenizing)."""
    line = CHAT.read_text().splitlines()[0]
    big = tmp_path / "big.jsonl"
    big.write_text((line + "\n") * 20_000)
    read = []
    rows = streamed.sources.rows

    def counted(*args, **kwargs):
        for row in rows(*args, **kwargs):
            read.append(row.where)
            yield row

    monkeypatch.setattr(streamed.sources, "rows", counted)
    stream = TextStream(folder, str(big), max_len=64)
    reading = iter(stream)
    for _ in range(3):
        next(reading)
    assert read == [f"{big}, line {n}" for n in (1, 2, 3)]
    assert stream.state_dict() == {"rows": 3, "drop": 0, "buffer": 0, "given": 0}
    made = []
    make = stream.make
    stream.make = lambda row: made.append(row) or make(row)
    stream.load_state_dict({"rows": 15_000, "drop": 0, "buffer": 0, "given": 0})
    next(iter(stream))
    assert len(made) == 1 and stream.state_dict()["rows"] == 15_001


def test_a_bad_packing_buffer_and_a_missing_file_are_one_line_at_start(folder, files):
    with pytest.raises(ValueError, match=r"^packing_buffer: 0: how many samples are packed together"):
        TextStream(folder, str(files / "chat.jsonl"), packing=True, packing_buffer=0)
    with pytest.raises(UserError, match=r"^files: .*nope.jsonl: no such file"):
        TextStream(folder, str(files / "nope.jsonl"))


# Whole runs of recipes/hf_sft.yaml: 20 conversations, batches of 8 (two a pass, the last 4 dropped), 6 steps
SHORT = ["on_cpu=null", "precision=fp32", "trainer.activation_checkpointing=null", "logging.tensorboard=false",
         "logging.memory_plan=false", "logging.progress_bar=false", "data.train.max_len=64", "data.batch_size=8",
         "optimizer={_target_: torch.optim.SGD, lr: 0.2}", "trainer.max_steps=6", "trainer.log_every=1",
         *float64("transformers.AutoModelForCausalLM.from_config")]  # compared within rounding (tests/rounding.py)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from recipes.components.hf_folder import write

    where = tmp_path_factory.mktemp("sft-stream")
    write(str(where / "tiny-llama"))
    (where / "chat.jsonl").write_text("\n".join(CHAT.read_text().splitlines()[:20]) + "\n")
    return where


def sft(base, *extra):
    return [str(RECIPE), f"model.config.pretrained_model_name_or_path={base / 'tiny-llama'}",
            f"data.train.files={base / 'chat.jsonl'}", *SHORT, *extra]


def here(base, run_dir, *extra):
    from launcher.recipe import load
    from launcher.run.train import train

    recipe, *overrides = sft(base, f"run_dir={run_dir}", *extra)
    return train(load(recipe, overrides))


def test_the_sft_recipe_streamed_trains_as_the_dataset_unshuffled_and_resumes_mid_epoch_bitwise(base, tmp_path,
                                                                                               capsys):
    here(base, tmp_path / "dataset", "data.shuffle=false", "checkpoint.every=null")
    capsys.readouterr()
    here(base, tmp_path / "whole", STREAM, "checkpoint.every=1", "checkpoint.keep=10")
    said = capsys.readouterr().out
    assert f"data.train: {base / 'chat.jsonl'}: streamed as chat, rows read and tokenized as they come" in said, said
    assert "data.train: tokenizer of " in said
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+)", said)]
    assert len(losses) == 6 and all(loss > 0 for loss in losses), said
    assert_within_rounding(tmp_path / "dataset" / "model.pt", tmp_path / "whole" / "model.pt", steps=6)
    whole = state_dict(tmp_path / "whole" / "model.pt")
    saved = torch.load(tmp_path / "whole" / "checkpoints" / "step_3" / "state.pt", weights_only=True)["stream"]
    assert saved[0]["epoch"] == 1 and saved[0]["batch"] == 1 and saved[0]["dataset"]["rows"] == 8, saved
    here(base, tmp_path / "resumed", STREAM, f"checkpoint.resume={tmp_path / 'whole' / 'checkpoints' / 'step_3'}",
         "checkpoint.every=null")
    said = capsys.readouterr().out
    assert "read again" not in said and "skipped" not in said, said
    resumed = state_dict(tmp_path / "resumed" / "model.pt")
    for key in whole:
        assert torch.equal(resumed[key], whole[key]), f"{key} differs after the resume"


def test_the_sft_recipe_streamed_and_packed_resumes_mid_epoch_bitwise(base, tmp_path, capsys):
    packed = [STREAM, "data.train.packing=true", "data.train.packing_buffer=6", "data.batch_size=4"]
    here(base, tmp_path / "whole", *packed, "checkpoint.every=1", "checkpoint.keep=10")
    said = capsys.readouterr().out
    assert "data.train: packing: 6 samples at a time packed into rows of at most 64 tokens" in said, said
    saved = torch.load(tmp_path / "whole" / "checkpoints" / "step_4" / "state.pt", weights_only=True)["stream"]
    assert saved[0]["dataset"]["given"] > 0, saved  # in the middle of a buffer
    here(base, tmp_path / "resumed", *packed, f"checkpoint.resume={tmp_path / 'whole' / 'checkpoints' / 'step_4'}",
         "checkpoint.every=null")
    whole, resumed = state_dict(tmp_path / "whole" / "model.pt"), state_dict(tmp_path / "resumed" / "model.pt")
    for key in whole:
        assert torch.equal(resumed[key], whole[key]), f"{key} differs after the resume"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_row_met_mid_run_is_one_line_from_a_loader_worker_too(base, tmp_path, workers):
    """The first global batch is checked at start; row 12 is met at the second step, in a worker or not."""
    lines = (base / "chat.jsonl").read_text().splitlines()
    lines[11] = json.dumps({"messages": [{"role": "bot", "content": "hi"}]})
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError) as raised:
        here(base, tmp_path / "run", STREAM, f"data.train.files={tmp_path / 'bad.jsonl'}", "checkpoint.every=null",
             f"data.num_workers={workers}")
    assert raised.value.problems == [f"{tmp_path / 'bad.jsonl'}, line 12: message 1 has the role 'bot'; a role is one "
                                     f"of system, user, assistant, tool (bad_rows: skip would skip such rows and count "
                                     f"them)"]


@pytest.mark.slow  # one torchrun launch of two processes
def test_ddp_two_processes_stream_the_weights_of_one_and_resume_exactly(base, tmp_path):
    from tests.several_runs import several

    here(base, tmp_path / "one", STREAM, "strategy=single", "checkpoint.every=null")
    cases = {"whole": [*sft(base, STREAM, f"run_dir={tmp_path / 'whole'}", "checkpoint.every=1", "checkpoint.keep=10",
                            "data.num_workers=2")],
             "resumed": [*sft(base, STREAM, f"run_dir={tmp_path / 'resumed'}", "checkpoint.every=null",
                              f"checkpoint.resume={tmp_path / 'whole' / 'checkpoints' / 'step_3'}")]}
    ranks = several(cases, tmp_path)
    assert [rank[case]["error"] for rank in ranks for case in cases] == [None] * 4, ranks
    assert "(ddp)" in ranks[0]["whole"]["said"]
    assert_within_rounding(tmp_path / "one" / "model.pt", tmp_path / "whole" / "model.pt", steps=6)
    ddp = state_dict(tmp_path / "whole" / "model.pt")
    resumed = state_dict(tmp_path / "resumed" / "model.pt")
    for key in ddp:
        assert torch.equal(resumed[key], ddp[key]), f"{key} differs after the resume"
