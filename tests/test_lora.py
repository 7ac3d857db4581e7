"""LoRA through peft (recipes/hf_lora.yaml): the base model's weights from an HF folder, frozen; the adapters
as peft builds them, trained; the same weights under one process, ddp (in a world of one, in this process),
fsdp x2 and tp x2 (peft's LoRA layers split with the layers they wrap); a resumed run ends bitwise equal; a LoRA
run's own checkpoint initialises a LoRA model whole; export merges the adapters or writes them as peft does."""

import json

import pytest
import torch

from tests.conftest import REPO, assert_same_weights, state_dict
from tests.rounding import assert_within_rounding, float64
from tests.test_hf_folders import folder

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
pytest.importorskip("peft", reason="the dev extra (peft) is not installed")

RECIPE = REPO / "recipes" / "hf_lora.yaml"
SHORT = ["on_cpu=null", "precision=fp32", "trainer.max_steps=6", "trainer.log_every=3", "trainer.eval_every=null",
         "checkpoint.every=null", "logging.tensorboard=false", "logging.progress_bar=false", "data.val=null",
         "data.batch_size=8", "optimizer.lr=0.01", "logging.memory_plan=false"]


def overrides(base, run_dir, *extra):
    return [f"model.model.config.pretrained_model_name_or_path={base}", f"run_dir={run_dir}", *SHORT, *extra]


def here(base, run_dir, *extra):
    from launcher.recipe import load
    from launcher.run.train import train

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
EXACT = [*SGD, *float64("peft.get_peft_model")]  # the runs compared within rounding (tests/rounding.py)


def test_lora_under_ddp_ends_as_one_process(tmp_path, one_rank):
    base = folder(tmp_path)
    here(base, tmp_path / "one", *SGD, "strategy=single")
    here(base, tmp_path / "ddp", *SGD, "strategy=ddp", "devices=cpu")
    one, ddp = state_dict(tmp_path / "one" / "model.pt"), state_dict(tmp_path / "ddp" / "model.pt")
    assert one.keys() == ddp.keys() and all(torch.equal(one[k], ddp[k]) for k in one)


# tp x 2 on the model's own plan (under peft's prefix): q_proj and v_proj split colwise with their lora_B, o_proj
# rowwise with its lora_A
TP = ["strategy=fsdp", "parallel.tp=2", "model.peft_config.target_modules=[q_proj,v_proj,o_proj]"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """LoRA under fsdp x2 and under tp x2 in one torchrun launch (tests/several_runs.py), and one process's runs."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("lora")
    base = folder(root)
    here(base, root / "one", *EXACT)
    here(base, root / "one-tp", *EXACT, TP[-1])
    return root, several({"fsdp": [RECIPE, *overrides(base, root / "fsdp", "strategy=fsdp", *EXACT)],
                          "tp": [RECIPE, *overrides(base, root / "tp", *TP, *EXACT)]}, root)


def assert_as_one(one, other):
    assert_within_rounding(one / "model.pt", other / "model.pt", steps=6)


@pytest.mark.slow
def test_lora_under_fsdp_x2_ends_as_one_process(two_ranks):
    root, ranks = two_ranks
    assert [results["fsdp"]["error"] for results in ranks] == [None, None]
    assert "fsdp.empty_init: a peft model's adapters are not in checkpoint.init_from's weights" in ranks[0]["fsdp"]["said"]
    assert_as_one(root / "one", root / "fsdp")


@pytest.mark.slow
def test_lora_under_tensor_parallel_splits_the_adapters_with_their_layers_and_ends_as_one_process(two_ranks):
    """Before: 'parallel.tp_plan: 'lm_head' names no module of the model (PeftModelForCausalLM)', a pattern of the
    plan the model wrapped by peft carries, in the wrapped model's names."""
    root, ranks = two_ranks
    assert [results["tp"]["error"] for results in ranks] == [None, None]
    said = ranks[0]["tp"]["said"]
    assert ("parallel.tp: 22 layers split over 2 ranks: base_model.model.lm_head (colwise_rep), "
            "base_model.model.model.embed_tokens (embedding_rowwise), "
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer (colwise), "
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default (colwise) and 18 more") in said
    assert_as_one(root / "one-tp", root / "tp")


def peft_llama(**lora):
    import peft

    from tests.test_parallel import llama

    return peft.get_peft_model(llama(), peft.LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", **lora))


def test_the_auto_plan_of_a_peft_model_is_its_base_model_s_with_each_adapter_split_as_its_layer():
    from launcher.parallel import plans

    model = peft_llama(target_modules=["q_proj", "o_proj"])
    modules = plans.matched(model, plans.resolve(model, "auto"))  # before: 'lm_head' names no module of the model
    layer = "base_model.model.model.layers.1.self_attn"
    assert modules["base_model.model.lm_head"] == "colwise_rep" and modules[f"{layer}.k_proj"] == "colwise"
    assert modules[f"{layer}.q_proj.base_layer"] == modules[f"{layer}.q_proj.lora_B.default"] == "colwise"
    assert modules[f"{layer}.o_proj.base_layer"] == modules[f"{layer}.o_proj.lora_A.default"] == "rowwise"
    assert not {f"{layer}.q_proj", f"{layer}.q_proj.lora_A.default", f"{layer}.o_proj.lora_B.default"} & modules.keys()
    assert len(modules) == 16 + 2 * 2 and plans.problems(model, modules, 2) == []  # a wrapper: its layer and adapter


@pytest.mark.parametrize("lora, line", [
    ({"target_modules": ["embed_tokens"]},
     "parallel.tp_plan: base_model.model.model.embed_tokens (embedding_rowwise) is peft.tuners.lora.layer.Embedding "
     "around an Embedding, which tensor parallel does not split"),
    ({"target_modules": ["q_proj"], "use_dora": True},
     "parallel.tp_plan: base_model.model.model.layers.0.self_attn.q_proj (colwise) is peft.tuners.lora.layer.Linear "
     "around a Linear, which tensor parallel does not split"),
], ids=["embedding", "dora"])
def test_adapters_tensor_parallel_cannot_split_are_one_line_each(lora, line):
    from launcher.errors import UserError
    from launcher.parallel import plans

    model = peft_llama(**lora)
    with pytest.raises(UserError) as caught:
        plans.matched(model, plans.resolve(model, "auto"))
    assert caught.value.problems[0].startswith(line), caught.value.problems
    assert caught.value.problems[0].endswith("(it splits LoRA on a Linear, colwise or rowwise); leave "
                                             f"{line.split()[1]} out of the plan or out of peft's target_modules")


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
