"""The character-level GPT recipe: its model, its dataset, and a tiny run of recipes/charlm.yaml on the CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.components.chars import CharText
from recipes.components.gpt import GPT, SequenceCrossEntropy
from tests.pace import paced

ROOT = Path(__file__).resolve().parents[1]
TEXT = "recipes/data/hamlet.txt"


def test_gpt_logits_shape_and_flops():
    torch.manual_seed(0)
    model = GPT(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
    idx = torch.randint(0, 65, (3, 10))
    logits = model(idx)
    assert logits.shape == (3, 10, 65)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    assert model.flops_per_token() > 6 * model.num_params() > 0
    loss = SequenceCrossEntropy()(logits, torch.randint(0, 65, (3, 10)))
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(65.0)).item()) < 0.5  # near uniform at init
    with pytest.raises(ValueError):
        model(torch.zeros(1, 17, dtype=torch.long))  # longer than block_size


def test_chartext_windows_and_split():
    block = 32
    train, val = CharText(TEXT, block, "train"), CharText(TEXT, block, "val")
    assert train.vocab_size == val.vocab_size == 65
    assert train.chars == val.chars
    # The two splits partition the whole file.
    n_chars = len((ROOT / TEXT).read_text(encoding="utf-8"))
    assert len(train.data) + len(val.data) == n_chars
    assert len(train) == (len(train.data) - 1) // block and len(val) == (len(val.data) - 1) // block
    assert len(train) > 8 * len(val) > 0
    for ds in (train, val):
        for i in (0, 1, len(ds) - 1):
            x, y = ds[i]
            assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (block,)
            assert torch.equal(x[1:], y[:-1])  # y is x shifted by one
            assert torch.equal(x, ds.data[i * block:(i + 1) * block].long())  # non-overlapping windows
            assert y[-1] == ds.data[(i + 1) * block]
    with pytest.raises(IndexError):
        train[len(train)]
    assert train.decode(train[0][0]).startswith("HAMLET")


def test_chartext_finds_its_file_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert CharText(TEXT, 64, "val").vocab_size == 65


LINE = re.compile(r"^step (\d+)/(\d+) \| epoch \d+ \| loss ([\d.]+) \|", re.MULTILINE)


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_tiny_charlm_run_learns(tmp_path):
    cmd = [sys.executable, "-m", "launcher", "recipes/charlm.yaml", "devices=cpu", "precision=fp32",
           "model.n_layer=1", "model.n_head=4", "model.n_embd=64", "model.block_size=32",
           "data.batch_size=16", "optimizer.lr=3e-3", "trainer.max_steps=60", "trainer.log_every=10",
           "checkpoint.every=null", "logging.tensorboard=false", "logging.progress_bar=false",
           "logging.memory_plan=false", f"run_dir={tmp_path}/run"]
    # Takes about 8 s on two idle cores; the timeout only guards against a hang.
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=paced(180))
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [(int(s), int(total), float(loss)) for s, total, loss in LINE.findall(done.stdout)]
    assert [s for s, _, _ in steps] == list(range(10, 61, 10)), done.stdout
    first, last = steps[0][2], steps[-1][2]
    assert last < first - 0.3, f"train loss went from {first} to {last}:\n{done.stdout}"
    assert "eval at step 60 | val/loss" in done.stdout
    assert (tmp_path / "run" / "model.pt").is_file()


def test_without_a_gpu_the_recipe_picks_its_cpu_size_and_says_so(monkeypatch):
    from launcher.recipe import load

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = load(ROOT / "recipes/charlm.yaml")
    assert (loaded.recipe.name, loaded.recipe.run_dir, loaded.recipe.precision) == ("charlm-cpu", "runs/charlm-cpu", "fp32")
    assert (loaded.recipe.model["n_layer"], loaded.recipe.model["n_embd"], loaded.recipe.model["_target_"]) == (
        2, 128, "recipes.components.gpt.GPT")
    assert loaded.notes[0].startswith("on_cpu: no GPU for this run (devices: auto); the recipe's on_cpu keys apply: "
                                      "name, precision, model.n_layer"), loaded.notes
    assert load(ROOT / "recipes/charlm.yaml", ["model.n_layer=3"]).recipe.model["n_layer"] == 3  # the command line wins
    assert load(ROOT / "recipes/charlm.yaml", ["on_cpu=null"]).recipe.model["n_layer"] == 6  # the GPU size, asked for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = load(ROOT / "recipes/charlm.yaml")
    assert (on_gpu.recipe.name, on_gpu.recipe.precision, on_gpu.notes) == ("charlm", "bf16", [])


def test_a_mistake_in_on_cpu_names_its_line(tmp_path):
    from launcher.errors import UserError
    from launcher.recipe import load

    recipe = tmp_path / "r.yaml"
    recipe.write_text((ROOT / "recipes/charlm.yaml").read_text().replace("trainer: {log_every: 25}",
                                                                          "trainer: {log_evry: 25}"))
    with pytest.raises(UserError, match=r"r.yaml:\d+: on_cpu: trainer.log_evry: unknown key; did you mean 'trainer.log_every'"):
        load(recipe, ["devices=cpu"])
