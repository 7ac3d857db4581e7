"""HF folders that do not fit what the recipe builds, found as a user finds them (issue 34): each is one line
naming what is wrong and what to do, at once, and no tensor of a folder is lost without a word. In-process
where the code path is a process's own (single, and ddp and fsdp as a torchrun world of one); torchrun x2
where the mistake needs two ranks (a tensor-parallel plan)."""

import shutil
from pathlib import Path

import pytest
import torch

from launcher.errors import UserError
from tests.conftest import launch, state_dict
from tests.test_hf_folders import RECIPE, export, folder, here, overrides

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

FSDP = ["strategy=fsdp", "devices=cpu"]
ONE_STEP = ["trainer.max_steps=1", "optimizer.lr=0.0"]


def with_own_head(tmp_path, name, head):
    """A folder whose config ties the output layer to the input embedding, holding an lm_head.weight of its
    own too: `head(embedding)` gives it."""
    from safetensors.torch import load_file, save_file

    path = folder(tmp_path, name, tie=True)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = head(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, tensors


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_tied_folder_with_another_output_layer_is_one_line_and_untied_keeps_both(tmp_path, strategy, request):
    """from_pretrained (transformers 5.23) unties such a folder and keeps both tensors; the launcher loaded the
    head over the embedding (exit 0). It now says so, and the line's way of untying keeps both."""
    how = [*FSDP] if strategy == "fsdp" else []
    if strategy == "fsdp":
        request.getfixturevalue("one_rank")
    base, saved = with_own_head(tmp_path, "own_head", lambda e: torch.randn_like(e))
    with pytest.raises(UserError) as info:
        here(base, tmp_path / "tied", *how, *ONE_STEP)
    assert info.value.problems == [
        f"checkpoint.init_from: {base}: 'lm_head.weight' differs from 'model.embed_tokens.weight' in the file, and "
        f"this model ties them (one parameter): loading both would lose one; build the model untied, as "
        f"from_pretrained does with such a file (an HF config's tie_word_embeddings: false, e.g. "
        f"model.config.tie_word_embeddings=false), or leave 'lm_head.weight' out of the file"]
    here(base, tmp_path / "untied", *how, *ONE_STEP, "model.config.tie_word_embeddings=false")
    got = state_dict(tmp_path / "untied" / "model.pt")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()
    for key in ("lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(got[key], saved[key]) and torch.equal(loaded[key], saved[key]), key
    # the same tensor under both names (what export writes for a tied model) loads tied, as before
    same, _ = with_own_head(tmp_path, "copied", lambda e: e.clone())
    here(same, tmp_path / "copied_run", *how, *ONE_STEP)
    got = state_dict(tmp_path / "copied_run" / "model.pt")
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_folder_of_another_model_is_refused_from_its_headers_alone(tmp_path, strategy, request, monkeypatch):
    """Under single and ddp the whole folder was read before the line; now the keys and shapes are checked
    from the safetensors headers first, as under fsdp."""
    from launcher.checkpoint import hf

    if strategy == "ddp":
        request.getfixturevalue("one_rank")
    other, base = folder(tmp_path, "other", width=32), folder(tmp_path)

    def read(*args, **kwargs):
        raise AssertionError("a tensor was read before the keys and shapes were checked")

    monkeypatch.setattr(hf.Slice, "read", read)
    with pytest.raises(UserError, match=rf"checkpoint.init_from: {other}: does not fit this model: 'model.embed_"
                                        rf"tokens.weight' is \(256, 32\) in the file, \(256, 64\) in the model"):
        here(base, tmp_path / "run", f"strategy={strategy}", f"checkpoint.init_from={other}")


def test_a_model_folder_that_is_not_there_is_one_line_at_once(tmp_path, monkeypatch):
    """A name that says a local path and is not there was asked of huggingface.co first (26 s without a
    network) before its line."""
    def asked(*args, **kwargs):
        raise AssertionError("transformers was asked for a folder that is not there")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
    for name, nearest in (("./no/such/folder", "."), (str(tmp_path / "gone"), str(tmp_path)),
                          ("recipes/tiny-lama", "recipes"), ("~/no-such-model-folder-x", "~")):
        with pytest.raises(UserError) as info:
            here(name, tmp_path / "run")
        said = info.value.problems
        there = Path(nearest).expanduser().absolute()
        assert said == [f"model.config.pretrained_model_name_or_path: {name}: no such folder (the nearest that is "
                        f"there: {there}); name a model folder as save_pretrained writes it, or a Hub repo id (NAME or "
                        f"OWNER/NAME)"], said


def test_a_folder_without_its_index_or_with_pytorch_model_bin_says_so(tmp_path):
    """Both said 'not a complete checkpoint (no valid manifest.json)'."""
    base = folder(tmp_path)
    shards = folder(tmp_path, "shards", shard_size="60KB")
    (shards / "model.safetensors.index.json").unlink()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(base / "config.json", pickled)
    torch.save(transformers.AutoModelForCausalLM.from_pretrained(base).state_dict(), pickled / "pytorch_model.bin")
    for source, start, end in (
        (shards, f"{shards}: safetensors shards (model-00001-of-", "...) without model.safetensors.index.json, which "
                 "names the shard of each tensor; copy it from where the shards came from (save_pretrained writes it "
                 "beside them)"),
        (pickled, f"{pickled}: holds pytorch_model.bin, which is not read", "(a pickle can run code as it loads); "
                  "convert the folder to safetensors once, e.g. AutoModelForCausalLM.from_pretrained(FOLDER)."
                  "save_pretrained(OUT, safe_serialization=True), and name OUT"),
    ):
        with pytest.raises(UserError) as info:
            here(base, tmp_path / "run", f"checkpoint.init_from={source}")
        (line,) = info.value.problems
        assert line.startswith(f"checkpoint.init_from: {start}") and line.endswith(end), line
        done = export(source, tmp_path / "out", "--format", "hf")  # export reads folders through the same door
        assert done.returncode == 2 and done.stderr.startswith(f"launcher: {start}") and done.stderr.count("\n") == 1, \
            done.stderr


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_lora_run_into_a_plain_model_names_peft_and_the_merge(tmp_path, strategy, request):
    """It said a base key 'is missing from the file' (a full checkpoint, whatever reads it) or 'from the
    checkpoint' (fsdp's own sharded checkpoint into a model built on meta)."""
    pytest.importorskip("peft", reason="the dev extra (peft) is not installed")
    from tests.test_lora import here as lora_here

    how = [*FSDP] if strategy == "fsdp" else []
    if strategy == "fsdp":
        request.getfixturevalue("one_rank")
    base = folder(tmp_path)
    lora, step = tmp_path / "lora", tmp_path / "lora" / "checkpoints" / "step_1"
    lora_here(base, lora, *how, "trainer.max_steps=1")
    with pytest.raises(UserError) as info:
        here(base, tmp_path / "run", *how, f"checkpoint.init_from={lora}")
    (line,) = info.value.problems
    said, named = ((f"{lora} (its weights in {step})", lora) if strategy == "single" else
                   (f"{lora}: does not fit this model", step))
    adapter = "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'" if strategy == "single" else \
        line.split("(its adapters, ", 1)[-1].split(", ...)", 1)[0]
    assert ".lora_" in adapter and line == (
        f"checkpoint.init_from: {said}: a peft model's weights (its adapters, {adapter}, ...), and this model is "
        f"not a peft model: merge the adapters into the base model's weights first, python -m launcher.export {named} "
        f"OUT --format hf --merge-lora, and initialise from OUT (or build this model with peft, as "
        f"recipes/hf_lora.yaml does)"), line
    done = export(named, tmp_path / "merged", "--format", "hf", "--merge-lora")  # what the line says works
    assert done.returncode == 0, done.stderr
    here(base, tmp_path / "run", *how, *ONE_STEP, f"checkpoint.init_from={tmp_path / 'merged'}")


def test_export_to_a_file_name_as_a_folder_is_refused(tmp_path):
    """`--format hf|peft OUT.pt` wrote a folder named OUT.pt."""
    base = folder(tmp_path)
    for fmt, name in (("hf", "y.pt"), ("peft", "y.safetensors"), ("hf", "y.bin")):
        done = export(base, tmp_path / name, "--format", fmt)
        assert done.returncode == 2 and not (tmp_path / name).exists(), done
        assert done.stderr.splitlines() == [
            f"launcher: {tmp_path / name}: --format {fmt} writes a folder, and this name ends in {name[1:]} as a "
            f"file's does; name a folder (e.g. {tmp_path / 'y'}), or leave --format out to write one .pt or "
            f".safetensors file"], done.stderr


@pytest.mark.slow
def test_a_bad_plan_on_the_meta_built_model_names_the_plan(tmp_path):
    """fsdp x tp 2 with init_from builds the model on the meta device, never whole: a first batch that fails
    through the split model was blamed on data.train."""
    base = folder(tmp_path)
    done = launch(str(RECIPE), *overrides(base, tmp_path / "run", "strategy=fsdp", "nproc_per_node=2", "parallel.tp=2",
                                          "parallel.tp_plan={model.layers.*.mlp.down_proj: colwise}"), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("launcher:")]
    assert len(said) == 1 and said[0].startswith(
        "launcher: parallel.tp_plan: the first batch does not go through the model split by the plan: RuntimeError: ")
    assert said[0].endswith("; the model was built on the meta device and not tried whole (fsdp.empty_init=false "
                            "tries it whole first, which tells the plan's mistake from the data's)"), said
