"""LoRA through peft (recipes/hf_lora.yaml): the base model's weights from an HF folder, frozen; the adapters
as peft builds them, trained; the same weights under one process, ddp (in a world of one, in this process)
and fsdp x2; a resumed run ends bitwise equal; a LoRA run's own checkpoint initialises a LoRA model whole;
export merges the adapters or writes them as peft does."""

import json

import pytest
import torch

from tests.conftest import REPO, assert_same_weights, launch, state_dict
from tests.test_hf_folders import folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
pytest.importorskip("peft", reason="the dev extra (peft) is not installed")

RECIPE = REPO / "recipes" / "hf_lora.yaml"
SHORT = ["on_cpu=null", "precision=fp32", "trainer.max_steps=6", "trainer.log_every=3", "trainer.eval_every=null",
         "checkpoint.every=null", "logging.tensorboard=false", "logging.progress_bar=false", "data.val=null",
         "data.batch_size=8", "optimizer.lr=0.01"]


def overrides(base, run_dir, *extra):
    return [f"model.model.config.pretrained_model_name_or_path={base}", f"run_dir={run_dir}", *SHORT, *extra]


def here(base, run_dir, *extra):
    from launcher.recipe import load
    from launcher.train import train

    return train(load(RECIPE, overrides(base, run_dir, *extra)))


def test_the_base_stays_as_loaded_and_the_adapters_learn(tmp_path, capsys):
    from safetensors.torch import load_file

    base = folder(tmp_path)
    here(base, tmp_path / "run")
    assert "(the base model's weights; its 8 adapter tensors as built)" in capsys.readouterr().out
    got, loaded = state_dict(tmp_path / "run" / "model.pt"), load_file(str(base / "model.safetensors"))
    prefix = "base_model.model."
    for key, tensor in loaded.items():  # frozen: the folder's weights, bitwise, under peft's names
        name = prefix + key.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.", "v_proj.base_layer.")
        assert torch.equal(got[name], tensor), name
    lora_b = [k for k in got if ".lora_B." in k]
    assert len(lora_b) == 4 and all(got[k].abs().sum() > 0 for k in lora_b)  # built as zeros, trained


def test_a_resumed_lora_run_ends_bitwise_and_its_checkpoint_initialises_a_lora_model_whole(tmp_path, capsys):
    base = folder(tmp_path)
    here(base, tmp_path / "straight", "checkpoint.every=3")
    here(base, tmp_path / "resumed", "checkpoint.every=3", "trainer.max_steps=3")
    here(base, tmp_path / "resumed", "checkpoint.every=3")
    assert_same_weights(tmp_path / "straight" / "model.pt", tmp_path / "resumed" / "model.pt")
    capsys.readouterr()
    here(base, tmp_path / "again", "trainer.max_steps=1", "optimizer.lr=0.0",
         f"checkpoint.init_from={tmp_path / 'straight'}")
    assert "adapter tensors as built" not in capsys.readouterr().out  # its own keys: adapters included
    assert_same_weights(tmp_path / "straight" / "model.pt", tmp_path / "again" / "model.pt")


SGD = ["optimizer._target_=torch.optim.SGD", "optimizer.lr=0.5"]  # as the other equivalence tests: Adam divides
# each adapter's first, nearly zero gradients by their own size, so that their last bits decide the step


def test_lora_under_ddp_ends_as_one_process(tmp_path, one_rank):
    base = folder(tmp_path)
    here(base, tmp_path / "one", *SGD, "strategy=single")
    here(base, tmp_path / "ddp", *SGD, "strategy=ddp", "devices=cpu")
    one, ddp = state_dict(tmp_path / "one" / "model.pt"), state_dict(tmp_path / "ddp" / "model.pt")
    assert one.keys() == ddp.keys() and all(torch.equal(one[k], ddp[k]) for k in one)


@pytest.mark.slow
def test_lora_under_fsdp_x2_ends_as_one_process(tmp_path):
    base = folder(tmp_path)
    here(base, tmp_path / "one", *SGD)
    done = launch(str(RECIPE), *overrides(base, tmp_path / "two", "strategy=fsdp", "nproc_per_node=2", *SGD), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fsdp.empty_init: a peft model's adapters are not in checkpoint.init_from's weights" in done.stdout
    one, two = state_dict(tmp_path / "one" / "model.pt"), state_dict(tmp_path / "two" / "model.pt")
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6, msg=key)


def test_export_merges_the_adapters_or_writes_them_as_peft_does(tmp_path):
    import peft
    import transformers

    from tests.test_hf_folders import export

    base = folder(tmp_path)
    here(base, tmp_path / "run", "checkpoint.export_hf=true", "checkpoint.every=3")
    cfg = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and cfg["peft_type"] == "LORA"
    trained = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base),
                                  peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trained.load_state_dict(state_dict(tmp_path / "run" / "model.pt"), strict=True)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained.eval()(ids).logits
        for out, args in (("merged", ["--format", "hf", "--merge-lora", "--max-shard-size", "60KB"]),
                          ("adapters", ["--format", "peft"])):
            done = export(tmp_path / "run" / "checkpoints" / "step_6", tmp_path / out, *args)
            assert done.returncode == 0, done.stderr
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert not any("lora" in k for k in merged.state_dict())
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)
        at_end = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")  # checkpoint.export_hf
        torch.testing.assert_close(at_end(ids).logits, expected, rtol=0, atol=1e-5)
        again = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapters")
        torch.testing.assert_close(again.eval()(ids).logits, expected, rtol=0, atol=1e-6)
    done = export(tmp_path / "run", tmp_path / "unmerged", "--format", "hf")
    assert done.returncode == 2 and not (tmp_path / "unmerged").exists()
    assert done.stderr.strip().splitlines() == [
        f"launcher: {tmp_path / 'run'}: a peft model's checkpoint (its adapters, "
        f"'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight', ...): give --merge-lora for the "
        f"base model with the adapters merged in, or --format peft for the adapters alone"], done.stderr
