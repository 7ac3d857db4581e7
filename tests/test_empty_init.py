"""Pretrained weights into shards: under fsdp with checkpoint.init_from the model is built on the meta
device, its shards allocated and filled with the slices each rank holds (launcher/model/empty.py,
launcher/checkpoint/sliced.py), from every source init_from reads. In-process: fsdp as a torchrun world
of one (gloo); tests/test_hf_folders.py runs two processes and measures host memory."""

import pytest
import torch
from torch import nn

from launcher.model import empty
from tests.conftest import state_dict
from tests.rounding import assert_within_float32_rounding
from tests.test_hf_folders import EXACT, folder, here

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

FSDP = ["strategy=fsdp", "devices=cpu"]


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied as HF ties: one Parameter in two modules
        self.register_buffer("steps", torch.arange(3.0), persistent=False)


def test_parameters_are_built_on_meta_buffers_real_ties_kept_and_no_random_numbers_drawn():
    torch.manual_seed(0)
    with empty.parameters_on_meta():
        model = WithBuffers()
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), after)  # the constructor's initialisation drew nothing
    assert all(p.device.type == "meta" for p in model.parameters()) and empty.is_empty(model)
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.steps, torch.arange(3.0)) and torch.equal(model.norm.running_var, torch.ones(4))
    assert isinstance(nn.Linear(2, 2).weight.device, torch.device) and nn.Linear(2, 2).weight.device.type == "cpu"
    empty.materialise(model, torch.device("cpu"))
    assert not empty.is_empty(model) and model.head.weight is model.embed.weight
    assert torch.equal(model.steps, torch.arange(3.0)) and torch.equal(model.norm.running_var, torch.ones(4))


def test_a_sharded_bf16_folder_with_tied_weights_loads_into_fp32_shards_as_into_one_process(tmp_path, one_rank, capsys):
    base = folder(tmp_path, dtype="bf16", tie=True, shard_size="60KB")
    here(base, tmp_path / "fsdp", *FSDP)
    said = capsys.readouterr().out
    assert f"initialised the model from {base} into this rank's shards" in said and "host memory: " in said
    here(base, tmp_path / "one")
    here(base, tmp_path / "exact", *EXACT)  # one process in float64: how far float32 rounds this training
    a = state_dict(tmp_path / "fsdp" / "model.pt")
    assert a["model.embed_tokens.weight"].dtype == torch.float32
    assert_within_float32_rounding(tmp_path / "one" / "model.pt", tmp_path / "fsdp" / "model.pt",
                                   tmp_path / "exact" / "model.pt")
    assert torch.equal(a["lm_head.weight"], a["model.embed_tokens.weight"])  # still one parameter after training


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_every_source_init_from_reads_fills_the_shards_alike(tmp_path, one_rank):
    """A .safetensors file, a torch file (memory-mapped), a run folder whose newest checkpoint is sharded
    (DCP reads each rank's part), and the built-whole path (fsdp.empty_init=false)."""
    from safetensors.torch import save_file

    base = folder(tmp_path)
    here(base, tmp_path / "whole", *FSDP, "fsdp.empty_init=false", "trainer.max_steps=1", "optimizer.lr=0.0")
    expected = state_dict(tmp_path / "whole" / "model.pt")
    torch.save(expected, tmp_path / "weights.pt")
    save_file({k: v for k, v in expected.items() if k != "lm_head.weight"} | {"lm_head.weight": expected["lm_head.weight"].clone()},
              str(tmp_path / "weights.safetensors"))
    here(base, tmp_path / "sharded_run", *FSDP, "trainer.max_steps=1", "optimizer.lr=0.0", "checkpoint.every=1")
    for source in ("weights.pt", "weights.safetensors", "sharded_run"):
        here(base, tmp_path / f"from_{source}", *FSDP, "trainer.max_steps=1", "optimizer.lr=0.0",
             f"checkpoint.init_from={tmp_path / source}")
        got = state_dict(tmp_path / f"from_{source}" / "model.pt")
        assert all(torch.equal(got[k], expected[k]) for k in expected), source


def test_weights_of_another_model_name_the_key_before_anything_is_read(tmp_path, one_rank):
    from launcher.errors import UserError

    other = folder(tmp_path, "other", width=32)
    base = folder(tmp_path)
    with pytest.raises(UserError, match=r"checkpoint.init_from: .*other: does not fit this model: "
                                        r"'model.embed_tokens.weight' is \(256, 32\) in the file, \(256, 64\) in the model"):
        here(base, tmp_path / "run", *FSDP, f"checkpoint.init_from={other}")


def test_a_model_loaded_by_from_pretrained_under_fsdp_gets_a_line_on_loading_it_in_shards(tmp_path, one_rank, capsys):
    base = folder(tmp_path)
    here(base, tmp_path / "run", *FSDP, "trainer.max_steps=1", "checkpoint.init_from=null",
         "model={_target_: transformers.AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path: " + str(base) + "}")
    said = capsys.readouterr().out
    assert ("model: transformers.AutoModelForCausalLM.from_pretrained loads the whole model on every rank; under fsdp, "
            "build it with from_config and name the folder in checkpoint.init_from") in said


def test_export_hf_without_consolidating_writes_the_folder_from_the_shards(tmp_path, one_rank):
    """checkpoint.export_hf with checkpoint.consolidate=never: no model.pt is gathered; rank 0 writes
    <run_dir>/hf/ from the last checkpoint's shards, as python -m launcher.export does."""
    from safetensors.torch import load_file

    from launcher.export import main

    base = folder(tmp_path)
    here(base, tmp_path / "run", *FSDP, "trainer.max_steps=2", "checkpoint.consolidate=never", "checkpoint.export_hf=true")
    assert not (tmp_path / "run" / "model.pt").exists()
    assert main([str(tmp_path / "run"), str(tmp_path / "cli"), "--format", "hf"]) == 0
    at_end, cli = (load_file(str(tmp_path / p / "model.safetensors")) for p in ("run/hf", "cli"))
    assert at_end.keys() == cli.keys() and all(torch.equal(at_end[k], cli[k]) for k in cli)
