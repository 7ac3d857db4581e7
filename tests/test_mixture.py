"""Text sources mixed by weight (launcher.data.text.Mixture, MixtureStream): each source's share of an epoch is its
weight's within rounding; a source's rows come each once before any comes twice; the items are a function of
(seed, epoch, index), so runs at one and two processes (torchrun, gloo) train on the same samples step by step,
and a run stopped and resumed, at its world size or another, on those of a run that went straight through;
preference sources' pairs and references pass through; a bad recipe is one line."""

import copy
import json
import pickle
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import REPO, in_this_process
from tests.mixture_probe import steps

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

from launcher.data.text import Mixture, MixtureStream, mixing  # noqa: E402

CHAT_ROWS, PC_ROWS = 12, 5


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny Llama folder (its tokenizer the sources'), 12 conversations and 5 prompt/completion rows."""
    from recipes.components.hf_folder import write

    root = tmp_path_factory.mktemp("mixture")
    write(str(root / "tiny-llama"))
    lines = (REPO / "recipes" / "data" / "chat.jsonl").read_text().splitlines()[:CHAT_ROWS]
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    (root / "pc.jsonl").write_text("".join(json.dumps({"prompt": f"question {i}?", "completion": f" answer {i}."})
                                           + "\n" for i in range(PC_ROWS)))
    return root


def sources(root, chat=3, pc=1):
    return [{"files": str(root / "chat.jsonl"), "weight": chat},
            {"files": str(root / "pc.jsonl"), "weight": pc, "format": "prompt_completion"}]


def mixture(root, **settings):
    return Mixture(str(root / "tiny-llama"), sources(root), max_len=64, cache=None, **settings)


def ids(item):
    return tuple(item["input_ids"].tolist())


@pytest.mark.parametrize("weights, total, expected", [
    ([0.7, 0.3], 430, [301, 129]), ([7, 3], 10, [7, 3]), ([1, 1, 1], 10, [4, 3, 3]),
    ([0.5, 0.25, 0.25], 7, [3, 2, 2]), ([1, 2], 1, [0, 1])])
def test_each_source_gets_its_share_by_largest_remainder(weights, total, expected):
    assert mixing.counts(weights, total) == expected


def test_each_epoch_holds_each_source_s_share_and_every_row_comes_once_before_any_twice(made):
    mixed = mixture(made, samples=20)  # 15 of the 12 conversations an epoch (upsampled), 5 of the 5 rows
    assert (len(mixed), mixed.counts, mixed.sizes) == (20, [15, 5], [CHAT_ROWS, PC_ROWS])
    assert Counter(mixed.source_of(i) for i in range(20)) == {0: 15, 1: 5}
    chat = [ids(mixed.at_epoch(epoch, i)) for epoch in range(4) for i in range(15)]  # 60 draws: 5 passes
    for start in range(0, 60, CHAT_ROWS):
        assert len(set(chat[start:start + CHAT_ROWS])) == CHAT_ROWS, start
    assert set(chat) == {ids(item) for item in mixed.sources[0]}
    assert chat[:CHAT_ROWS] != chat[CHAT_ROWS:2 * CHAT_ROWS]  # each pass a fresh order
    rows = [{ids(mixed.at_epoch(epoch, i)) for i in range(15, 20)} for epoch in range(2)]
    assert rows[0] == rows[1] == {ids(item) for item in mixed.sources[1]}

    fewer = mixture(made, samples=8)  # 6 conversations an epoch: the next epoch's are the other 6
    assert fewer.counts == [6, 2]
    two = [ids(fewer.at_epoch(epoch, i)) for epoch in range(2) for i in range(6)]
    assert len(set(two)) == CHAT_ROWS
    assert "sources.0 (" in fewer.notes[-2] and "6 samples an epoch (75.0% of samples)" in fewer.notes[-2]
    assert "of tokens); of its 12 samples 6 of them (downsampled: others the next epoch)" in fewer.notes[-2]


def test_an_item_is_a_function_of_the_seed_the_epoch_and_its_index(made):
    one, again, other = mixture(made), mixture(made), mixture(made, seed=1)
    assert len(one) == CHAT_ROWS + PC_ROWS and one.counts == [13, 4]
    first = [ids(one.at_epoch(1, i)) for i in range(len(one))]
    assert first == [ids(again.at_epoch(1, i)) for i in reversed(range(len(one)))][::-1]
    assert first != [ids(one.at_epoch(0, i)) for i in range(len(one))]
    assert first != [ids(other.at_epoch(1, i)) for i in range(len(one))]
    assert [ids(one[i]) for i in range(3)] == [ids(one.at_epoch(0, i)) for i in range(3)]
    copied = pickle.loads(pickle.dumps(one))  # as loader workers get it
    assert [ids(copied.at_epoch(1, i)) for i in range(len(one))] == first


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_asks_for_each_epoch_s_own_items(made, workers):
    from launcher.data.sampling import Position, TrainData

    mixed = mixture(made)
    data = TrainData(mixed, 4, 1, 1, 0, False, 0, workers, torch.device("cpu"), collate_fn=list)
    try:
        epochs = {}
        for (epoch, number), batch in data.host_batches(Position()):
            epochs.setdefault(epoch, []).extend(ids(item) for item in batch)
            if epoch == 2:
                break
    finally:
        data.close()
    for epoch in (0, 1):
        assert epochs[epoch] == [ids(mixed.at_epoch(epoch, i)) for i in range(16)]
    assert epochs[0] != epochs[1]


def test_a_stream_is_interleaved_by_weight_and_resumes_at_any_item(made, monkeypatch):
    monkeypatch.setattr(mixing, "BLOCK", 8)
    stream = MixtureStream(str(made / "tiny-llama"), sources(made), max_len=64)
    items = list(copy.deepcopy(stream))
    chat = {ids(item) for item in copy.deepcopy(stream.sources[0])}
    origin = [0 if ids(item) in chat else 1 for item in items]
    # the epoch ends as the 5 rows do (a quarter of 20 items), the 12 conversations read again meanwhile
    assert origin.count(1) == PC_ROWS and origin.count(0) > CHAT_ROWS and len(items) in range(17, 25)
    for block in range(len(items) // 8):
        assert Counter(origin[8 * block:8 * block + 8]) == {0: 6, 1: 2}
    assert origin[:8] != origin[8:16]  # shuffled within each block
    for cut in (1, 7, 8, 9, len(items) - 1):
        first = copy.deepcopy(stream)
        read = iter(first)
        head = [next(read) for _ in range(cut)]
        resumed = copy.deepcopy(stream)
        resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
        assert [ids(item) for item in head + list(resumed)] == [ids(item) for item in items], cut
    stream.set_epoch(1)
    assert [ids(item) for item in stream] != [ids(item) for item in items]
    assert stream.notes[-2:] == [f"sources.0 ({made / 'chat.jsonl'}, weight 3): 75.0% of samples",
                                 f"sources.1 ({made / 'pc.jsonl'}, weight 1): 25.0% of samples"]


class Pairs:
    """A preference source as the contract of issue 53 has it: `files` names how many pairs it holds."""

    pairwise = True  # as TextDataset's format preference says it (every TextDataset has the methods)

    def __init__(self, tokenizer, files, **settings):
        self.n, self.name, self.values = int(files), files, None
        self.notes, self.pad_id, self.largest, self.samples = [], 0, 0, None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"pair": (self.name, i), "ref": None if self.values is None else self.values[i]}

    def check_vocabulary(self, rows):
        return None

    def pairs(self):
        return self.n

    def pair_item(self, k):
        return {"pair": (self.name, k)}

    def attach_reference(self, values):
        self.values = list(values)

    def reference_key(self):
        return f"key of {self.name}"


def test_preference_sources_pass_their_pairs_and_references_through(monkeypatch):
    import launcher.data.text.mixture as module

    monkeypatch.setattr(module, "TextDataset", Pairs)
    mixed = Mixture("folder", [{"files": "3", "weight": 1}, {"files": "2", "weight": 1}], samples=4)
    assert mixed.pairs() == 5
    assert [mixed.pair_item(k)["pair"] for k in range(5)] == [("3", 0), ("3", 1), ("3", 2), ("2", 0), ("2", 1)]
    key = mixed.reference_key()
    assert key == Mixture("folder", [{"files": "3", "weight": 2}, {"files": "2", "weight": 1}]).reference_key()
    assert key != Mixture("folder", [{"files": "2", "weight": 1}, {"files": "3", "weight": 1}]).reference_key()
    mixed.attach_reference([f"ref {k}" for k in range(5)])
    assert mixed.sources[0].values == ["ref 0", "ref 1", "ref 2"] and mixed.sources[1].values == ["ref 3", "ref 4"]
    assert {(mixed[i]["pair"], mixed[i]["ref"]) for i in range(4)} <= {
        (("3", k), f"ref {k}") for k in range(3)} | {(("2", k), f"ref {3 + k}") for k in range(2)}
    copied = pickle.loads(pickle.dumps(mixed))
    assert copied.pairs() == 5 and copied.pair_item(3)["pair"] == ("2", 0)
    with pytest.raises(ValueError, match=r"attach_reference: 4 values for the mixture's 5 pairs"):
        mixed.attach_reference([0.0] * 4)


def recipe(root, data, **changes):
    """hf_sft.yaml with `data` for data.train, written beside the data."""
    config = OmegaConf.load(REPO / "recipes" / "hf_sft.yaml")
    config.data.train = data
    for key, value in changes.items():
        OmegaConf.update(config, key, value, force_add=True)
    path = root / f"recipe-{len(list(root.glob('recipe-*.yaml')))}.yaml"
    OmegaConf.save(config, path)
    return path


def train(tmp_path, made, name, sources_):
    return {"_target_": f"launcher.data.text.{name}", "tokenizer": "${model.config.pretrained_model_name_or_path}",
            "max_len": 64, "seed": "${seed}", "sources": sources_}


@pytest.mark.parametrize("sources_, line", [
    ("empty", "sources: []: a list of sources, each {files: ..., weight: ...} and its own settings"),
    ("a.jsonl", "sources: 'a.jsonl': a list of sources"),
    ("two", "sources.1.weight: -1: a positive number, the source's share of the samples relative to the other "
            "sources' weights"),
    ("word", "sources.1.weight: 'much': a positive number"),
    ("none", "sources.0.weight: missing: a positive number"),
    ("key", "sources.1.colums: not a setting of a source; one of weight, files, format, columns, template"),
    ("format", "sources.1.format: 'tweets' is not one of"),
])
def test_a_bad_mixture_is_one_line_naming_its_key(made, tmp_path, sources_, line):
    good = sources(made)
    given = {"two": [good[0], {**good[1], "weight": -1}], "word": [good[0], {**good[1], "weight": "much"}],
             "none": [{"files": good[0]["files"]}], "key": [good[0], {**good[1], "colums": {"prompt": "q"}}],
             "format": [good[0], {**good[1], "format": "tweets"}], "empty": []}.get(sources_, sources_)
    path = recipe(tmp_path, train(tmp_path, made, "Mixture", given))
    code, out, err = in_this_process(str(path), f"model.config.pretrained_model_name_or_path={made / 'tiny-llama'}",
                                     f"run_dir={tmp_path / 'run'}", "on_cpu=null", "precision=fp32")
    assert code == 2, out + err
    said = [said for said in err.splitlines() if said.strip()]
    assert len(said) == 1 and "data.train: launcher.data.text.Mixture failed with the recipe's arguments: " \
                               "ValueError: " in said[0] and line in said[0], err


RUN = ["on_cpu=null", "precision=fp32", "trainer.activation_checkpointing=null", "logging.tensorboard=false",
       "logging.progress_bar=false", "logging.memory_plan=false", "data.batch_size=4", "trainer.max_steps=8",
       "trainer.log_every=4", "optimizer={_target_: torch.optim.SGD, lr: 0.1}"]


@pytest.mark.slow  # one torchrun launch of two processes
def test_one_and_two_processes_and_resumes_train_on_the_same_samples_step_by_step(made, tmp_path, monkeypatch):
    """Map-style (12 samples an epoch: 3 steps) and streamed (an epoch of about 4 steps): 8 steps through two epoch
    ends at one process, at two, and resumed from step 3 (of the one-process run) at one and at two."""
    from tests.several_runs import several

    monkeypatch.setenv("LAUNCHER_CACHE", str(tmp_path / "cache"))
    kinds = {"map": recipe(tmp_path, {**train(tmp_path, made, "Mixture", sources(made)), "samples": 12}),
             "stream": recipe(tmp_path, train(tmp_path, made, "MixtureStream", sources(made)))}

    def args(kind, run, *extra):
        return [str(kinds[kind]), f"model.config.pretrained_model_name_or_path={made / 'tiny-llama'}",
                f"run_dir={tmp_path / run}", *RUN, *extra,
                f"step={{_target_: tests.mixture_probe.Recorded, folder: '{tmp_path / run / 'seen'}'}}"]

    for kind in kinds:
        code, out, err = in_this_process(*args(kind, f"{kind}-one", "checkpoint.every=3", "checkpoint.keep=5"))
        assert code == 0, (out + err)[-3000:]
        assert "data.train: mixture of 2" in out
        resumed = ["checkpoint.every=null", f"checkpoint.resume={tmp_path / f'{kind}-one' / 'checkpoints' / 'step_3'}"]
        code, out, err = in_this_process(*args(kind, f"{kind}-resumed-one", *resumed))
        assert code == 0, (out + err)[-3000:]
    cases = {f"{kind} {how}": args(kind, f"{kind}-{how}", "strategy=ddp", *extra) for kind in kinds
             for how, extra in (("two", ["checkpoint.every=null"]),
                                ("resumed-two", ["checkpoint.every=null", "checkpoint.resume="
                                                 f"{tmp_path / f'{kind}-one' / 'checkpoints' / 'step_3'}"]))}
    ranks = several(cases, tmp_path)
    assert [rank[case]["error"] for rank in ranks for case in cases] == [None] * 2 * len(cases), ranks
    for kind in kinds:
        one = steps(tmp_path / f"{kind}-one" / "seen")
        assert len(one) == 8 and len({row for step in one for row in step}) > 8
        assert steps(tmp_path / f"{kind}-two" / "seen", ranks=2) == one
        assert steps(tmp_path / f"{kind}-resumed-one" / "seen") == one[3:]
        assert steps(tmp_path / f"{kind}-resumed-two" / "seen", ranks=2) == one[3:]
