"""Activation checkpointing (`trainer.activation_checkpointing`): the same weights, fewer saved activations,
the plain model's keys; the class finder it shares with FSDP's units."""

import pytest
import torch
from torch import nn

from launcher.model import modules
from launcher.model import recompute
from launcher.errors import UserError
from recipes.components.gpt import GPT
from recipes.components.mlp import MLP
from tests.conftest import REPO, assert_same_weights, launch, state_dict

TINY = dict(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False)
CHARLM = REPO / "recipes" / "charlm.yaml"
SMALL_CHARLM = ["devices=cpu", "precision=fp32", "logging.tensorboard=false", "logging.progress_bar=false", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
                "model.block_size=32", "model.dropout=0.0", "data.batch_size=8", "data.val=null", "trainer.max_steps=10",
                "lr_schedule=null", "logging.memory_plan=false"]


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return total[0]


def test_saved_activations_shrink_and_gradients_stay():
    torch.manual_seed(0)
    plain, recomputing = GPT(**TINY), GPT(**TINY)
    recomputing.load_state_dict(plain.state_dict())
    assert recompute.apply(recomputing, ["Block"]) == 2
    x = torch.randint(0, 65, (4, 32))
    before, after = saved_bytes(plain, x), saved_bytes(recomputing, x)
    assert after < before / 2, (before, after)
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputing.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)  # recomputed exactly on the CPU
    assert list(recomputing.state_dict()) == list(plain.state_dict())
    assert type(recomputing.transformer.h[0]).__name__ == "Block"


def test_a_block_inside_a_recomputed_block_is_not_recomputed_twice():
    outer = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4))
    assert recompute.apply(outer, ["Sequential"]) == 1


def test_dataparallel_replicas_recompute_their_own_parameters():
    torch.manual_seed(0)
    plain = MLP()
    recomputing = MLP()
    recomputing.load_state_dict(plain.state_dict())
    recompute.apply(recomputing, ["Linear"])
    x = torch.randn(8, 32)
    nn.DataParallel(plain)(x).sum().backward()  # on the CPU DataParallel calls the module itself
    nn.DataParallel(recomputing)(x).sum().backward()
    for a, b in zip(plain.parameters(), recomputing.parameters()):
        assert torch.equal(a.grad, b.grad)


def charlm(run_dir, *overrides):
    from launcher.recipe import load
    from launcher.run.train import train

    return train(load(CHARLM, [*SMALL_CHARLM, f"run_dir={run_dir}", *overrides]))


def test_training_with_it_gives_the_same_weights(tmp_path):
    charlm(tmp_path / "plain")
    charlm(tmp_path / "ac", "trainer.activation_checkpointing=[Block]")
    assert_same_weights(tmp_path / "plain" / "model.pt", tmp_path / "ac" / "model.pt")
    GPT(**TINY).load_state_dict(state_dict(tmp_path / "ac" / "model.pt"), strict=True)


def test_a_class_the_model_lacks_is_one_line(tmp_path):
    done = launch("recipes/quickstart.yaml", "trainer.activation_checkpointing=[Block]", f"run_dir={tmp_path}")
    assert done.returncode == 2
    assert done.stderr.strip().endswith("trainer.activation_checkpointing: the model has no class Block; its classes: "
                                        "MLP, Linear, ReLU"), done.stderr


def test_default_units():
    assert modules.default_units(GPT(**TINY)) == ["Block"]
    assert modules.default_units(MLP()) == []
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    assert modules.default_units(transformers.GPT2LMHeadModel(config)) == ["GPT2Block"]


def test_by_class_names_every_missing_class():
    with pytest.raises(UserError, match="fsdp.units: the model has no class A, B; its classes: GPT, "):
        modules.by_class(GPT(**TINY), ["A", "Block", "B"], "fsdp.units")


def test_auto_names_the_model_s_repeated_blocks_as_fsdp_finds_its_units(tmp_path):
    from launcher.recipe import load

    assert recompute.chosen(GPT(**TINY), "auto") == ["Block"]  # the layers of its ModuleList
    assert recompute.chosen(GPT(**TINY), ["Block"]) == ["Block"]
    with pytest.raises(UserError, match=r"^trainer.activation_checkpointing: auto finds no repeated blocks in MLP \(no "
                                        r"_no_split_modules, no ModuleList of layers\); name the classes to recompute, "
                                        r"of its: MLP, Linear, ReLU$"):
        recompute.chosen(MLP(), "auto")
    with pytest.raises(UserError, match=r"trainer.activation_checkpointing: must be a list of class names "
                                        r"\(\[Block\]\), auto \(the model's repeated blocks\) or null, got 'Block'$"):
        load(CHARLM, ["trainer.activation_checkpointing=Block"])
    assert load(CHARLM, ["trainer.activation_checkpointing=[]"]).recipe.trainer.activation_checkpointing == []  # off
    charlm(tmp_path / "named", "trainer.activation_checkpointing=[Block]")
    charlm(tmp_path / "auto", "trainer.activation_checkpointing=auto")
    assert_same_weights(tmp_path / "named" / "model.pt", tmp_path / "auto" / "model.pt")


@pytest.mark.parametrize("arch, block", [("qwen2", "Qwen2DecoderLayer"), ("gpt2", "GPT2Block")])
def test_the_fine_tuning_recipe_recomputes_any_causal_lm_s_blocks(tmp_path, capsys, arch, block):
    """recipes/hf_finetune.yaml says "Llama, Qwen, ...": it named LlamaDecoderLayer, so a Qwen2 or GPT-2 folder
    ended with exit 2 before a step; `auto` takes the blocks from the model, as fsdp's units do."""
    from launcher.recipe import load
    from launcher.run.train import train
    from tests import hf_zoo

    pytest.importorskip("transformers").utils.logging.disable_progress_bar()
    getattr(hf_zoo, arch)().save_pretrained(tmp_path / arch)
    train(load(REPO / "recipes" / "hf_finetune.yaml", [
        f"model.config.pretrained_model_name_or_path={tmp_path / arch}", f"run_dir={tmp_path / 'run'}", "devices=cpu",
        "trainer.max_steps=2", "trainer.eval_every=null", "data.train.max_len=32", "data.val=null",
        "checkpoint.every=null", "logging.tensorboard=false", "logging.progress_bar=false"]))
    out = capsys.readouterr().out
    assert f"activation checkpointing: 2 modules ({block}) recompute their activations in backward" in out, out
    assert f"initialised the model from {tmp_path / arch}" in out and (tmp_path / "run" / "model.pt").exists()
