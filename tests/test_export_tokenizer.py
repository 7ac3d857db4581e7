"""An exported HF folder is a whole model folder: the tokenizer's files go beside the weights (checkpoint.export_hf
and python -m launcher.export --format hf), from the folder the run's tokenizer came from (data.train.tokenizer,
else checkpoint.init_from's), or --tokenizer's; AutoTokenizer and AutoModelForCausalLM both load it, and
recipes/hf_dpo.yaml trains from an SFT run's export naming the folder alone. Without a tokenizer the model is
written alone and a line says so; a tokenizer's files are checked as the launcher checks them before any is
copied."""

import json

import pytest
import torch

from tests.conftest import REPO
from tests.test_hf_folders import export

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
pytest.importorskip("safetensors", reason="the dev extra (safetensors) is not installed")

SHORT = ["on_cpu=null", "precision=fp32", "trainer.activation_checkpointing=null", "checkpoint.every=null",
         "logging.tensorboard=false", "logging.progress_bar=false", "logging.memory_plan=false", "data.batch_size=8",
         "trainer.max_steps=2", "trainer.log_every=1",
         "optimizer={_target_: torch.optim.SGD, lr: 0.2}"]
TEXT = ["data.train.max_len=64", "data.train.cache=null"]  # the text recipes' data
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny(path, **kwargs):
    from recipes.components.hf_folder import write

    write(str(path), layers=1, width=32, **kwargs)
    return path


def train(recipe, *overrides):
    from launcher.recipe import load
    from launcher.run.train import train as run

    return run(load(REPO / "recipes" / recipe, [*SHORT, *overrides]))


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """An SFT run of the tiny folder that ends with its HF folder (checkpoint.export_hf): (base, run folder)."""
    root = tmp_path_factory.mktemp("export-tokenizer")
    base = tiny(root / "base")
    train("hf_sft.yaml", f"model.config.pretrained_model_name_or_path={base}", f"run_dir={root / 'sft'}",
          "checkpoint.export_hf=true", *TEXT)
    return base, root / "sft"


def test_an_sft_runs_hf_folder_holds_its_tokenizer_and_loads_whole(sft):
    base, run = sft
    for name in TOKENIZER_FILES:  # byte for byte
        assert (run / "hf" / name).read_bytes() == (base / name).read_bytes(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(run / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "hf")
    assert tokenizer.eos_token_id == 1 and tokenizer.chat_template == (base / "chat_template.jinja").read_text()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], return_tensors="pt", return_dict=True)
    assert model(**ids).logits.shape[-1] == model.config.vocab_size


def test_dpo_trains_from_an_sft_export_naming_the_folder_alone(sft, tmp_path, capsys):
    _, run = sft
    capsys.readouterr()
    train("hf_dpo.yaml", f"model.config.pretrained_model_name_or_path={run / 'hf'}", f"run_dir={tmp_path / 'dpo'}",
          "data.batch_size=4", *TEXT)
    out = capsys.readouterr().out
    assert f"data.train: tokenizer of {run / 'hf'}:" in out and "done: step 2" in out, out
    assert (tmp_path / "dpo" / "model.pt").is_file()


def test_the_run_says_where_its_export_gets_the_tokenizer_and_export_reads_the_runs_recipe(sft, tmp_path):
    base, run = sft
    done = export(run, tmp_path / "out", "--format", "hf")
    assert done.returncode == 0, done.stderr
    assert (f"tokenizer: {tmp_path / 'out'} gets the tokenizer files of {base} (data.train.tokenizer in "
            f"{run / 'recipe.yaml'})") in done.stdout, done.stdout
    assert all((tmp_path / "out" / name).read_bytes() == (base / name).read_bytes() for name in TOKENIZER_FILES)
    transformers.AutoTokenizer.from_pretrained(tmp_path / "out")


def test_without_a_tokenizer_folder_the_model_is_written_alone_and_said(tmp_path, capsys):
    base = tiny(tmp_path / "base", tokenizer=False)
    train("hf_finetune.yaml", f"model.config.pretrained_model_name_or_path={base}", f"run_dir={tmp_path / 'run'}",
          "checkpoint.export_hf=true", "data.val=null", "trainer.eval_every=null")
    out = capsys.readouterr().out
    assert (f"tokenizer: none found (no data.train.tokenizer, checkpoint.init_from '{base}' holds no tokenizer files): "
            f"{tmp_path / 'run' / 'hf'} holds the model alone") in out, out
    assert sorted(p.name for p in (tmp_path / "run" / "hf").iterdir()) == ["config.json", "generation_config.json",
                                                                           "model.safetensors"]
    done = export(tmp_path / "run", tmp_path / "out", "--format", "hf")
    assert done.returncode == 0 and "tokenizer: none found" in done.stdout, done.stdout + done.stderr
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_tokenizer_names_the_folder_and_its_mistakes_are_one_line(tmp_path):
    base = tiny(tmp_path / "base")
    plain = tiny(tmp_path / "plain", tokenizer=False)
    torch.save(transformers.AutoModelForCausalLM.from_pretrained(plain).state_dict(), tmp_path / "weights.pt")
    config = ["--config", plain / "config.json"]
    done = export(tmp_path / "weights.pt", tmp_path / "none", "--format", "hf", *config)
    assert done.returncode == 0 and "tokenizer: none found (no run recipe (recipe.yaml)" in done.stdout, done.stdout
    done = export(tmp_path / "weights.pt", tmp_path / "named", "--format", "hf", *config, "--tokenizer", base)
    assert done.returncode == 0, done.stderr
    assert f"gets the tokenizer files of {base} (--tokenizer)" in done.stdout, done.stdout
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "named").chat_template
    for out, args, says in (
        ("o", ["--format", "hf", *config, "--tokenizer", plain], f"--tokenizer {plain}: holds no tokenizer files"),
        ("o", ["--format", "hf", *config, "--tokenizer", tmp_path / "gone"], f"--tokenizer {tmp_path / 'gone'}: no "),
        ("o.pt", ["--tokenizer", base], "--tokenizer: its files go into an HF folder; give --format hf with it"),
    ):
        done = export(tmp_path / "weights.pt", tmp_path / out, *args)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr


def bad_folders(tmp_path, base):
    """Tokenizer folders whose files the launcher refuses, each with the start of the line that says so."""
    import shutil

    def copy(name):
        shutil.copytree(base, tmp_path / name, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        return tmp_path / name

    huge = copy("huge")
    with open(huge / "tokenizer.json", "r+b") as f:
        f.truncate(1 << 30)  # a gigabyte that takes no disk
    deep = copy("deep")
    (deep / "tokenizer_config.json").write_text("[" * 40 + "]" * 40)
    nested = copy("nested")
    (nested / "tokenizer_config.json").write_text(json.dumps({"a": json.loads("[" * 40 + "]" * 40)}))
    template = copy("template")
    (template / "chat_template.jinja").write_text("x" * ((1 << 20) + 1))
    return [(huge, f"{huge / 'tokenizer.json'}: more than 64 MiB"),
            (deep, f"{deep / 'tokenizer_config.json'}: holds a list; a tokenizer config is a JSON object"),
            (nested, f"{nested / 'tokenizer_config.json'}: nested more than 32 levels deep"),
            (template, f"{template / 'chat_template.jinja'}: more than 1 MiB; a chat template is a few KB of Jinja")]


def test_a_tokenizers_files_are_checked_before_anything_is_written(tmp_path):
    base = tiny(tmp_path / "base")
    for folder, says in bad_folders(tmp_path, base):
        out = tmp_path / f"out-{folder.name}"
        done = export(base, out, "--format", "hf", "--tokenizer", folder)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith(f"launcher: {says}") or says in done.stderr, done.stderr
        assert not out.exists() and not out.with_name(f".{out.name}.partial").exists()


def test_the_folder_is_chosen_from_the_recipe_as_the_run_used_it(tmp_path):
    from launcher.checkpoint.hf_tokenizer import of_recipe

    base, plain = tiny(tmp_path / "base"), tiny(tmp_path / "plain", tokenizer=False)
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"")

    def recipe(tokenizer, init_from):
        return {"data": {"train": {"tokenizer": tokenizer}}, "checkpoint": {"init_from": init_from}}

    assert of_recipe(recipe(str(base), str(plain))) == (base, "data.train.tokenizer")
    assert of_recipe(recipe("Qwen/Qwen3-0.6B", str(base))) == (base, "checkpoint.init_from")  # a hub name
    assert of_recipe(recipe(str(plain), str(base))) == (base, "checkpoint.init_from")
    assert of_recipe(recipe(None, str(weights))) == (None, f"no data.train.tokenizer, checkpoint.init_from "
                                                           f"'{weights}' holds no tokenizer files")
    assert of_recipe(recipe("Qwen/Qwen3-0.6B", "s3://bucket/run")) == (
        None, "data.train.tokenizer 'Qwen/Qwen3-0.6B' is no local tokenizer folder, checkpoint.init_from "
              "'s3://bucket/run' holds no tokenizer files")
    assert of_recipe({"data": {"train": [1, 2]}, "checkpoint": {}}) == (None, "no data.train.tokenizer, no "
                                                                               "checkpoint.init_from")
