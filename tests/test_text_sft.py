"""recipes/hf_sft.yaml trains: chat SFT from the tiny Llama folder (its BPE tokenizer and ChatML template) and
recipes/data/chat.jsonl, the loss on the answers going down; packed rows give the padded samples' step; under
ddp x2 the same samples give one process's weights (within rounding, in float64), and a malformed row is the
same one line on every rank."""

import json
import re

import pytest
import torch

from tests.conftest import REPO, state_dict
from tests.rounding import assert_within_rounding, float64
from tests.several_runs import several

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

RECIPE = REPO / "recipes" / "hf_sft.yaml"
SHORT = ["on_cpu=null", "precision=fp32", "trainer.activation_checkpointing=null", "checkpoint.every=null",
         "logging.tensorboard=false", "logging.progress_bar=false", "data.train.max_len=64", "data.batch_size=8",
         "logging.memory_plan=false", *float64("transformers.AutoModelForCausalLM.from_config")]  # (tests/rounding.py)
# SGD, as the other equivalence tests: Adam divides nearly-zero first gradients by their own size
SGD = ["optimizer={_target_: torch.optim.SGD, lr: 0.2}", "trainer.max_steps=4", "trainer.log_every=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from recipes.components.hf_folder import write

    folder = tmp_path_factory.mktemp("sft") / "tiny-llama"
    write(str(folder))
    return folder


def here(base, run_dir, *extra):
    from launcher.recipe import load
    from launcher.run.train import train

    return train(load(RECIPE, [f"model.config.pretrained_model_name_or_path={base}", f"run_dir={run_dir}", *SHORT,
                               *extra]))


def test_the_sft_recipe_trains_on_the_answers_and_its_loss_falls(base, tmp_path, capsys):
    here(base, tmp_path, "trainer.max_steps=16", "trainer.log_every=1")
    out = capsys.readouterr().out
    assert f"data.train: tokenizer of {base}: 249 tokens, BOS '<s>' (0), EOS '</s>' (1), no PAD (EOS stands in for " \
           f"it); the tokenizer's chat template, its answers found by rendering each conversation's beginnings" in out
    assert re.search(r"data.train: recipes/data/chat.jsonl: 400 rows as chat -> 400 samples of \d+ to 64 tokens, "
                     r"\d+ tokens, \d+% of them targets \(loss_on: answers\)", out), out
    assert re.search(r"data.train: \d+ of 400 samples longer than max_len 64 tokens: truncated at it", out)
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+)", out)]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses


def test_one_step_on_packed_rows_is_the_step_on_the_same_samples_padded(base, tmp_path, capsys):
    from launcher.data.text import TextDataset

    lines = (REPO / "recipes" / "data" / "chat.jsonl").read_text().splitlines()[:12]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    rows = len(TextDataset(str(base), str(tmp_path / "chat.jsonl"), max_len=64, packing=True))
    assert rows < 12
    common = [f"data.train.files={tmp_path / 'chat.jsonl'}", "trainer.max_steps=1", "trainer.log_every=1",
              "optimizer={_target_: torch.optim.SGD, lr: 0.5}"]
    padded = here(base, tmp_path / "padded", *common, "data.batch_size=12")
    packed = here(base, tmp_path / "packed", *common, "data.train.packing=true", f"data.batch_size={rows}")
    assert f"data.train: packing: 12 samples into {rows} rows of at most 64 tokens" in capsys.readouterr().out
    assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=1e-5)
    tokens = sum(len(s["input_ids"]) for s in TextDataset(str(base), str(tmp_path / "chat.jsonl"), max_len=64).samples)
    for values, samples in ((padded, 12), (packed, rows)):  # tokens/s counts the samples' tokens, not padding
        assert values["train/tokens_per_s"] / values["train/samples_per_s"] * samples == pytest.approx(tokens, rel=1e-6)
    assert_within_rounding(tmp_path / "padded" / "model.pt", tmp_path / "packed" / "model.pt", steps=1)


@pytest.mark.slow  # one torchrun launch of two processes
def test_ddp_two_processes_give_one_process_weights_and_a_bad_row_is_one_line_on_each(base, tmp_path):
    here(base, tmp_path / "one", *SGD, "strategy=single")
    bad = tmp_path / "bad.jsonl"
    good = (REPO / "recipes" / "data" / "chat.jsonl").read_text().splitlines()[0]
    bad.write_text(good + "\n" + json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    common = [str(RECIPE), f"model.config.pretrained_model_name_or_path={base}", *SHORT, *SGD]
    packed = ["data.train.packing=true", "data.batch_size=4"]
    ranks = several({"ddp": [*common, f"run_dir={tmp_path / 'ddp'}"],
                     "bad": [*common, f"run_dir={tmp_path / 'bad'}", f"data.train.files={bad}"],
                     "tp": [*common, *packed, f"run_dir={tmp_path / 'tp'}", "strategy=fsdp", "parallel.tp=2",
                            "logging.jsonl=true"]}, tmp_path)
    assert [rank["ddp"]["error"] for rank in ranks] == [None, None]
    # tokens/s of packed rows under tensor parallelism (both ranks hold the same rows) is one process's
    alone = here(base, tmp_path / "packed", *SGD, *packed, "strategy=single")
    logged = json.loads((tmp_path / "tp" / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["train/tokens_per_s"] / logged["train/samples_per_s"] == pytest.approx(
        alone["train/tokens_per_s"] / alone["train/samples_per_s"], rel=1e-6), logged
    assert "(ddp)" in ranks[0]["ddp"]["said"]
    assert_within_rounding(tmp_path / "one" / "model.pt", tmp_path / "ddp" / "model.pt", steps=4)
    one, loaded = state_dict(tmp_path / "one" / "model.pt"), state_dict_of(base)
    assert any(not torch.equal(one[key], loaded[key].to(one[key].dtype)) for key in one)  # it trained
    line = (f"UserError: {bad}, line 2: message 1 has the role 'bot'; a role is one of system, user, assistant, tool "
            f"(bad_rows: skip would skip such rows and count them)")
    assert [rank["bad"]["error"] for rank in ranks] == [line, line]


def state_dict_of(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))
