"""Checkpoints: DESIGN's run folder, unwrapped keys, atomic writes, retention, tolerant and safe loading."""

import json
import pickle

import pytest
import torch
from torch import nn

from launcher.checkpoint import Checkpointer, load_model_state
from launcher.errors import UserError
from recipes.components.mlp import MLP
from tests.conftest import launch, state_dict, train


def test_run_folder_matches_design(tmp_path):
    train(tmp_path, "checkpoint.every=20", "checkpoint.keep=2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "model.pt", "recipe.yaml"]
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["latest", "step_60", "step_80"]  # the newest two kept
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_80"
    step = tmp_path / "checkpoints" / "step_80"
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json", "model.pt", "state.pt"]
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["step"] == 80 and manifest["files"]["model.pt"] == (step / "model.pt").stat().st_size
    state = torch.load(step / "state.pt", weights_only=True)
    assert {"optimizer", "lr_schedule", "scaler", "position", "rng", "recipe"} <= state.keys()
    assert "name: quickstart" in state["recipe"] and "name: quickstart" in (tmp_path / "recipe.yaml").read_text()


def test_model_file_is_the_plain_state_dict(tmp_path):
    train(tmp_path)
    for path in (tmp_path / "model.pt", tmp_path / "checkpoints" / "step_80" / "model.pt"):
        saved = state_dict(path)
        assert not any(k.startswith(("module.", "_orig_mod.")) or ".module." in k for k in saved)
        assert all(t.device.type == "cpu" for t in saved.values())
        MLP(in_dim=32, hidden=128, classes=10).load_state_dict(saved, strict=True)


def test_resume_takes_the_newest_complete_checkpoint(tmp_path):
    keeper = Checkpointer(tmp_path, keep=5, writer=True)
    model = MLP()
    keeper.save(10, model.state_dict(), {"x": 1})
    keeper.save(20, model.state_dict(), {"x": 2})
    (tmp_path / "checkpoints" / "step_20" / "manifest.json").unlink()  # as if killed before the manifest
    (tmp_path / "checkpoints" / "step_30").mkdir()  # an empty folder
    assert keeper.resume_from("auto") == tmp_path / "checkpoints" / "step_10"
    assert keeper.resume_from("never") is None
    with pytest.raises(UserError, match="is incomplete"):
        keeper.resume_from(str(tmp_path / "checkpoints" / "step_20"))


def test_a_truncated_file_makes_its_checkpoint_incomplete(tmp_path):
    keeper = Checkpointer(tmp_path, keep=5, writer=True)
    keeper.save(10, MLP().state_dict(), {})
    keeper.save(20, MLP().state_dict(), {})
    model_file = tmp_path / "checkpoints" / "step_20" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])
    assert keeper.resume_from("auto").name == "step_10"


def test_retention_never_deletes_the_newest_complete(tmp_path):
    keeper = Checkpointer(tmp_path, keep=1, writer=True)
    for step in (1, 2, 3):
        keeper.save(step, MLP().state_dict(), {})
    assert [p.name for p in keeper.complete()] == ["step_3"]


def test_non_writers_write_nothing(tmp_path):
    keeper = Checkpointer(tmp_path, keep=1, writer=False)
    assert keeper.save(1, MLP().state_dict(), {}) is None and keeper.save_final({}) is None
    assert not any(tmp_path.iterdir())


class Compiled(nn.Module):
    """The layout of torch.compile's OptimizedModule (the model under `_orig_mod`), without starting
    inductor's compile workers, which would slow every later test on a small machine."""

    def __init__(self, model):
        super().__init__()
        self._orig_mod = model


@pytest.mark.parametrize("wrap", [
    lambda m: nn.DataParallel(m),
    lambda m: Compiled(m),
    lambda m: nn.DataParallel(Compiled(m)),
], ids=["module.", "_orig_mod.", "module._orig_mod."])
def test_init_from_accepts_wrapper_prefixes(tmp_path, wrap):
    source = MLP()
    wrapped = wrap(source)
    torch.save(wrapped.state_dict(), tmp_path / "wrapped.pt")
    assert next(iter(wrapped.state_dict())).startswith(("module.", "_orig_mod."))
    target = MLP()
    load_model_state(target, tmp_path / "wrapped.pt")
    for a, b in zip(source.state_dict().values(), target.state_dict().values()):
        assert torch.equal(a, b)


def test_init_from_in_a_recipe(tmp_path):
    source = MLP()
    torch.save(nn.DataParallel(source).state_dict(), tmp_path / "dp.pt")
    train(tmp_path / "run", f"checkpoint.init_from={tmp_path / 'dp.pt'}", "trainer.max_steps=1",
          "optimizer.lr=0.0")
    final = state_dict(tmp_path / "run" / "model.pt")
    assert all(torch.equal(final[k], v) for k, v in source.state_dict().items())


def test_another_models_checkpoint_names_the_first_difference(tmp_path):
    torch.save(MLP(hidden=64).state_dict(), tmp_path / "other.pt")
    with pytest.raises(UserError, match=r"'0.weight' is \(64, 32\) in the file, \(128, 32\) in the model"):
        load_model_state(MLP(), tmp_path / "other.pt")
    torch.save(MLP(layers=1).state_dict(), tmp_path / "fewer.pt")
    with pytest.raises(UserError, match=r"'2.weight' is \(10, 128\) in the file, \(128, 128\) in the model"):
        load_model_state(MLP(), tmp_path / "fewer.pt")
    partial = MLP().state_dict()
    del partial["4.bias"]
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(UserError, match="'4.bias' is missing from the file"):
        load_model_state(MLP(), tmp_path / "partial.pt")
    torch.save({**MLP().state_dict(), "extra.weight": torch.zeros(1)}, tmp_path / "extra.pt")
    with pytest.raises(UserError, match="the file has 'extra.weight', which the model lacks"):
        load_model_state(MLP(), tmp_path / "extra.pt")
    done = launch("recipes/quickstart.yaml", f"checkpoint.init_from={tmp_path / 'other.pt'}", f"run_dir={tmp_path / 'r'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().endswith("does not fit this model: '0.weight' is (64, 32) in the file, (128, 32) in the model")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_file_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"0.weight": _RunsCode(str(marker))}, f)
    torch.save({"0.weight": _RunsCode(str(marker))}, tmp_path / "evil2.pt")
    marker.unlink(missing_ok=True)  # torch.save pickles without calling it; make sure
    for name in ("evil.pt", "evil2.pt"):
        with pytest.raises(UserError, match="weights_only=True"):
            load_model_state(MLP(), tmp_path / name)
    assert not marker.exists()
