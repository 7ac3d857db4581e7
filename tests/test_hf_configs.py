"""HF models built from their configs in YAML alone, with the config keys transformers takes through
PretrainedConfig rather than the config class's signature (num_labels, decoder_start_token_id,
attn_implementation, ...): the recipe check accepts what the call accepts, and a keyword the call
refuses is still one line naming it."""

import pytest
import yaml

from tests.conftest import launch

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

TEXT = {"train": {"_target_": "tests.hf_zoo.text"}, "batch_size": 8,
        "collate": {"_target_": "launcher.data.collate.Pad", "values": {"labels": -100}}}
IMAGES = {"train": {"_target_": "tests.hf_zoo.Images", "n": 64}, "batch_size": 8}
SMALL = dict(num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
MODELS = {
    "t5": ("T5ForConditionalGeneration", "T5Config", TEXT,
           dict(vocab_size=256, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
                decoder_start_token_id=0, pad_token_id=0)),
    "vit": ("ViTForImageClassification", "ViTConfig", IMAGES,
            dict(hidden_size=16, image_size=16, patch_size=8, num_labels=4, **SMALL)),
    "bert": ("BertForMaskedLM", "BertConfig", TEXT,
             dict(vocab_size=256, hidden_size=16, max_position_embeddings=128, attn_implementation="eager", **SMALL)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", TEXT,
              dict(vocab_size=256, hidden_size=16, max_position_embeddings=128, num_labels=3,
                   attn_implementation="sdpa", **SMALL)),
}


def recipe(tmp_path, name: str) -> str:
    model, config, data, keys = MODELS[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "run_dir": str(tmp_path / name),
        "model": {"_target_": f"transformers.{model}", "config": {"_target_": f"transformers.{config}", **keys}},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-3}, "data": data,
        "trainer": {"max_steps": 2, "log_every": 1}, "checkpoint": {"every": None},
        "logging": {"tensorboard": False, "progress_bar": False, "memory_plan": False}}))
    return str(path)


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
def test_a_config_key_that_pretrainedconfig_takes_trains(name, tmp_path):
    from launcher.recipe import load
    from launcher.run.train import train

    values = train(load(recipe(tmp_path, name), []))
    assert values["train/loss"] > 0 and (tmp_path / name / "model.pt").exists()


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_t5_with_its_decoder_start_token_trains_from_the_command_line(tmp_path):
    done = launch(recipe(tmp_path, "t5"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "done: step 2" in done.stdout


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_keyword_the_call_refuses_is_one_line(tmp_path):
    done = launch(recipe(tmp_path, "t5"), "data.train={_target_: tests.hf_zoo.blobs, n: 64, clases: 4}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "launcher: data.train.clases: 'tests.hf_zoo.blobs' takes no argument 'clases'; did you mean 'classes'?"]
