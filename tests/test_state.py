"""The run state in one place (launcher/checkpoint/): the strategy reads and writes the model's and the
optimizer's state, keyed by parameter names, so a checkpoint of any strategy resumes under any other.
In-process runs: fsdp as a torchrun world of one (gloo)."""

import json
import re

import pytest

import torch

from launcher.checkpoint.full import named_optimizer_state
from recipes.components.mlp import MLP
from tests.conftest import assert_same_weights, state_dict, train
from tests.pace import paced
from tests.rounding import assert_within_rounding, float64


def test_fsdp_in_a_world_of_one_gives_the_single_weights(tmp_path, one_rank):
    exact = float64("recipes.components.mlp.MLP")  # compared within rounding (tests/rounding.py)
    train(tmp_path / "fsdp", *exact, "strategy=fsdp", "devices=cpu", "checkpoint.every=40", "trainer.grad_accum_steps=2",
          "trainer.clip_grad_norm=0.5")
    manifest = json.loads((tmp_path / "fsdp" / "checkpoints" / "step_40" / "manifest.json").read_text())
    assert manifest["format"] == 3 and manifest["world_size"] == 1
    train(tmp_path / "single", *exact, "strategy=single", "checkpoint.every=40", "trainer.grad_accum_steps=2",
          "trainer.clip_grad_norm=0.5")
    assert_within_rounding(tmp_path / "single" / "model.pt", tmp_path / "fsdp" / "model.pt", steps=80)
    MLP().load_state_dict(state_dict(tmp_path / "fsdp" / "model.pt"), strict=True)


def test_a_sharded_checkpoint_resumes_in_a_single_process_exactly(tmp_path, one_rank, monkeypatch):
    train(tmp_path / "whole", "strategy=fsdp", "devices=cpu", "checkpoint.every=40")
    train(tmp_path / "half", "strategy=fsdp", "devices=cpu", "checkpoint.every=40", "trainer.max_steps=40")
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var)
    train(tmp_path / "half", "strategy=single", "checkpoint.every=40")  # continues the fsdp run's step_40
    assert_same_weights(tmp_path / "whole" / "model.pt", tmp_path / "half" / "model.pt")


def test_optimizer_state_of_the_first_checkpoints_is_named():
    model = MLP()
    optimizer = torch.optim.AdamW([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}])
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    named = named_optimizer_state(optimizer.state_dict(), model, optimizer)
    names = [n for n, _ in model.named_parameters()]
    assert [g["params"] for g in named["param_groups"]] == [names[:2], names[2:]]
    assert torch.equal(named["state"][names[3]]["exp_avg"], optimizer.state_dict()["state"][3]["exp_avg"])
    assert named_optimizer_state(named, model, optimizer) is named  # already named: as it is


def test_asynchronous_saves_hold_the_weights_of_their_own_step(tmp_path, one_rank):
    common = ["strategy=fsdp", "devices=cpu", "checkpoint.every=20", "checkpoint.keep=5", "checkpoint.consolidate=every"]
    train(tmp_path / "async", *common, "checkpoint.async_save=true")
    train(tmp_path / "sync", *common)
    for step in (20, 40, 60, 80):
        at = f"checkpoints/step_{step}/model.pt"
        assert_same_weights(tmp_path / "sync" / at, tmp_path / "async" / at)
    assert_same_weights(tmp_path / "sync" / "model.pt", tmp_path / "async" / "model.pt")


def test_a_sharded_checkpoint_of_another_model_is_one_line(tmp_path, one_rank):
    from launcher.errors import UserError

    train(tmp_path / "a", "strategy=fsdp", "devices=cpu", "checkpoint.every=40", "trainer.max_steps=40")
    with pytest.raises(UserError, match=r"checkpoint.resume: .*step_40 does not fit this run \("):
        train(tmp_path / "b", "strategy=fsdp", "devices=cpu", "model.hidden=64",
              f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / 'step_40'}")


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
@pytest.mark.parametrize("damaged", [".metadata", "__0_0.distcp"])
def test_a_truncated_sharded_file_is_named_by_resume_auto_explicit_resume_and_export(tmp_path, one_rank, capsys, damaged):
    """A sharded checkpoint whose .metadata or shard lost its end (the manifest intact): explicit resume and
    export said "no valid manifest.json", and resume=auto passed over it without a word. Now each names the
    file, its size and the manifest's, and auto resumes from the checkpoint before it, as for a flipped bit."""
    import subprocess
    import sys

    from launcher.errors import UserError
    from tests.conftest import REPO

    run = tmp_path / "run"
    common = ["strategy=fsdp", "devices=cpu", "checkpoint.every=20", "checkpoint.keep=5"]
    train(run, *common, "trainer.max_steps=40")
    step = run / "checkpoints" / "step_40"
    size = (step / damaged).stat().st_size
    with open(step / damaged, "r+b") as f:
        f.truncate(size - 10)
    says = f"damaged ({damaged}: {size - 10} bytes, the manifest says {size})"
    with pytest.raises(UserError, match=rf"^checkpoint.resume: {step} is {re.escape(says)}; pick another folder"):
        train(tmp_path / "other", *common, f"checkpoint.resume={step}")
    exported = subprocess.run([sys.executable, "-m", "launcher.export", str(step), str(tmp_path / "o.pt")], cwd=REPO,
                              capture_output=True, text=True, timeout=paced(120))
    assert exported.returncode == 2 and exported.stderr.strip() == f"launcher: {step}: {says}; use another checkpoint"
    capsys.readouterr()
    train(run, *common, "trainer.max_steps=60")
    out = capsys.readouterr().out
    assert f"{step} is {says}; resuming from the checkpoint before it" in out and \
        f"resumed from {run / 'checkpoints' / 'step_20'}" in out, out
