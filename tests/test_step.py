"""The step: batches of any structure, models that return their own loss, and what does not fit."""

import dataclasses
from collections import namedtuple

import pytest
import torch

from launcher.data import collate
from launcher.data.device import each_tensor
from launcher.model import step
from tests.conftest import QUICKSTART, launch, train

def test_the_tutorials_data_without_targets_and_a_model_that_returns_its_loss(tmp_path):
    from launcher.recipe import load
    from launcher.run.train import train as run

    overrides = ["model={_target_: tests.components_step.AutoEncoder}", "loss=null", "metrics={}",
                 "data.train={_target_: tests.components_step.RandomDataset}", "data.val=null",
                 "data.batch_size=32", "trainer.max_steps=40", "trainer.log_every=5", "checkpoint.every=null",
                 "logging.tensorboard=false", "logging.progress_bar=false", "logging.memory_plan=false",
                 f"run_dir={tmp_path}"]
    first = run(load(QUICKSTART, [*overrides, "trainer.max_steps=5", f"run_dir={tmp_path / 'a'}"]))
    last = run(load(QUICKSTART, overrides))
    assert last["train/loss"] < first["train/loss"]
    model = __import__("tests.components_step", fromlist=["AutoEncoder"]).AutoEncoder()
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)


def test_a_model_without_a_loss_and_no_loss_in_the_recipe_says_what_to_add(tmp_path):
    done = launch(str(QUICKSTART), "loss=null", f"run_dir={tmp_path}", "trainer.max_steps=1")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "launcher: loss: required: without loss: the model gets the batch as model(*batch) and must return its loss, "
        "but that gives TypeError: Sequential.forward() takes 2 positional arguments but 3 were given; add loss: "
        "{_target_: ...} (called as loss(model(input), target) on (input, target) batches), or a step:")


def test_a_loss_the_step_cannot_take_is_one_line(tmp_path):
    done = launch(str(QUICKSTART), "step={_target_: launcher.model.step.ModelLoss}", f"run_dir={tmp_path}",
                  "trainer.max_steps=1")
    assert done.returncode == 2
    assert done.stderr.strip() == ("launcher: loss: unused: step launcher.model.step.ModelLoss takes no loss argument; "
                                   "remove loss:, or give the step the arguments it takes")


def test_a_step_that_counts_some_batches_only_is_one_line(tmp_path, monkeypatch):
    calls = []

    def sometimes(model, batch):
        x, y = batch
        calls.append(1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return {"loss": loss, "num_items": torch.tensor(len(y))} if len(calls) % 3 else {"loss": loss}

    monkeypatch.setattr(step, "select", lambda loss: sometimes)
    from launcher.errors import UserError

    with pytest.raises(UserError, match="step: returns num_items for some batches and not for others"):
        train(tmp_path, "metrics={}")


def test_model_loss_calls_the_model_as_the_batch_is_shaped():
    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, y=None):
            seen.append((type(x).__name__, y is not None))
            return {"loss": self.w * x.sum()} if y is None else (self.w * (x - y)).pow(2).mean()

    own = step.ModelLoss()
    for batch in (torch.ones(2), (torch.ones(2), torch.zeros(2)), {"x": torch.ones(2), "id": ["a", "b"]}):
        out = step.result(own(Model(), batch))
        assert out.loss.dim() == 0 and out.num_items is None
    assert seen == [("Tensor", False), ("Tensor", True), ("Tensor", False)]
    assert own.left_out == ["id"]  # a mapping key forward does not name stays in the batch


def test_model_loss_counts_the_targets_of_a_model_that_takes_loss_keywords():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, input_ids, labels=None, **kwargs):
            kept = (labels != -100).float()
            return {"loss": (self.w * kept).sum() / kwargs["num_items_in_batch"]}

    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    out = step.result(step.ModelLoss()(Counting(), {"input_ids": labels.clamp(min=0), "labels": labels}))
    assert out.num_items.item() == 3 and out.loss.item() == 1.0  # no causal shift: not a causal LM loss


def test_tensors_anywhere_in_a_batch_are_moved_and_other_leaves_kept():
    @dataclasses.dataclass
    class Pair:
        a: torch.Tensor
        name: str

    Named = namedtuple("Named", "x y")
    batch = {"pair": Pair(torch.zeros(1), "p"), "list": [torch.zeros(1), ("s", torch.zeros(1))],
             "named": Named(torch.zeros(1), 3)}
    moved = each_tensor(batch, lambda t: t + 1)
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.item() == 1 and moved["pair"].name == "p"
    assert moved["list"][0].item() == 1 and moved["list"][1][0] == "s" and moved["list"][1][1].item() == 1
    assert isinstance(moved["named"], Named) and moved["named"].x.item() == 1 and moved["named"].y == 3


def test_dataclass_items_collate_field_by_field_and_pad_pads():
    @dataclasses.dataclass
    class Item:
        x: torch.Tensor
        label: int

    batch = collate.default([Item(torch.zeros(2), 1), Item(torch.ones(2), 2)])
    assert isinstance(batch, Item) and batch.x.shape == (2, 2) and batch.label.tolist() == [1, 2]
    padded = collate.Pad(values={"labels": -100})([
        {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, 6, 7]), "id": "a"},
        {"input_ids": torch.tensor([8]), "labels": torch.tensor([8]), "id": "b"}])
    assert padded["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert padded["labels"].tolist() == [[5, 6, 7], [8, -100, -100]] and padded["id"] == ["a", "b"]


def test_items_in_reads_the_first_tensor():
    assert step.items_in({"id": ["a", "b", "c"], "x": torch.zeros(3, 4)}) == 3
    assert step.items_in((torch.zeros(5), torch.zeros(5))) == 5
