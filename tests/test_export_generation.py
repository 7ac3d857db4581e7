"""An exported HF folder holds the generation config, as save_pretrained writes it: the one of the folder the run's
model came from, byte for byte (a Llama 3 instruct model names its end-of-turn token there alone), else the model's
own; GenerationConfig.from_pretrained and AutoModelForCausalLM read it from the export. The file is untrusted
input: a bad one is one line, before training."""

import json

import pytest

from tests.test_export_tokenizer import TEXT, tiny, train
from tests.test_hf_folders import export

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
pytest.importorskip("safetensors", reason="the dev extra (safetensors) is not installed")

# What Llama 3 instruct folders hold: more than one end token, and the sampling they were published with.
PUBLISHED = {"bos_token_id": 0, "eos_token_id": [1, 2], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
             "transformers_version": "4.45.0"}


def test_the_source_folders_generation_config_goes_with_every_export(tmp_path):
    base = tiny(tmp_path / "base")
    raw = (json.dumps(PUBLISHED, indent=2) + "\n").encode()
    (base / "generation_config.json").write_bytes(raw)
    run = tmp_path / "sft"
    train("hf_sft.yaml", f"model.config.pretrained_model_name_or_path={base}", f"run_dir={run}",
          "checkpoint.export_hf=true", *TEXT)
    assert (run / "hf" / "generation_config.json").read_bytes() == raw
    done = export(run, tmp_path / "out", "--format", "hf")
    assert done.returncode == 0 and "generation_config.json" in done.stdout, done.stdout + done.stderr
    for folder in (run / "hf", tmp_path / "out"):
        generation = transformers.GenerationConfig.from_pretrained(folder)
        assert generation.eos_token_id == [1, 2] and generation.temperature == 0.6 and generation.do_sample
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert model.generation_config.eos_token_id == [1, 2]
    # an HF folder exported again keeps its own
    done = export(run / "hf", tmp_path / "again", "--format", "hf")
    assert done.returncode == 0 and (tmp_path / "again" / "generation_config.json").read_bytes() == raw, done.stderr


def test_without_one_in_the_folder_the_models_own_is_written_as_save_pretrained_would(tmp_path):
    base = tiny(tmp_path / "base", tokenizer=False)
    (base / "generation_config.json").unlink()
    run = tmp_path / "run"
    train("hf_finetune.yaml", f"model.config.pretrained_model_name_or_path={base}", f"run_dir={run}",
          "checkpoint.export_hf=true", "data.val=null", "trainer.eval_every=null")
    saved = tmp_path / "saved"
    config = transformers.AutoConfig.from_pretrained(base)  # the model as the recipe builds it: from_config
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(saved)
    ours, theirs = (transformers.GenerationConfig.from_pretrained(f).to_dict() for f in (run / "hf", saved))
    assert ours == theirs and ours["eos_token_id"] == 1 and ours["bos_token_id"] == 0, (ours, theirs)


@pytest.mark.parametrize("content, says", [
    ("[" * 40 + "]" * 40, "holds a list; a generation config is a JSON object"),
    (json.dumps({"a": json.loads("[" * 20 + "]" * 20)}), "nested more than 8 levels deep"),
    ("{not json", "not a readable JSON generation config"),
    (None, "more than 1 MiB; a generation config is a few hundred bytes of JSON"),
])
def test_a_bad_generation_config_is_one_line_before_training(tmp_path, capsys, content, says):
    from launcher.errors import UserError

    base = tiny(tmp_path / "base", tokenizer=False)
    path = base / "generation_config.json"
    if content is None:
        with open(path, "r+b") as f:
            f.truncate(1 << 30)  # a gigabyte that takes no disk
    else:
        path.write_text(content)
    with pytest.raises(UserError) as info:
        train("hf_finetune.yaml", f"model.config.pretrained_model_name_or_path={base}", f"run_dir={tmp_path / 'run'}",
              "data.val=null", "trainer.eval_every=null")
    assert str(info.value).startswith(f"{path}: {says}"), str(info.value)
    assert not (tmp_path / "run" / "model.pt").exists()
