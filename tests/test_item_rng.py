"""Randomness inside items (augmentation in `__getitem__`, a stream's generator, a masking collate) is a
function of (seed, epoch, item index) alone: a resumed run ends bitwise equal to an uninterrupted one
whatever data.num_workers, and the items are the same whatever the world size (launcher/data/item_rng.py)."""

import random
import sys

import numpy as np
import pytest
import torch

from launcher.data import item_rng
from tests.conftest import assert_same_weights, train
from tests.rounding import assert_within_rounding, float64
from tests.test_loop import stop_after

AUGMENTED = ["data.train._target_=tests.components.Augmented", "data.val=null", "model._target_=tests.components.Dropout",
             "data.collate={_target_: tests.components.masked, _partial_: true}"]
STREAM = [*AUGMENTED, "data.train._target_=tests.components.AugmentedStream"]


def resumed(folder, *extra):
    """Trained to step 40, killed right after saving it, and run again to the end (80 steps)."""
    train(folder, "checkpoint.every=40", *extra)
    stop_after(folder, 40)
    train(folder, "checkpoint.every=40", *extra)
    return folder / "model.pt"


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
@pytest.mark.parametrize("data", [AUGMENTED, STREAM], ids=["map-style", "stream"])
def test_random_items_resume_bitwise_and_ignore_the_number_of_workers(tmp_path, data):
    """With 2 workers a resumed run ended 1e-2 away: the workers' seeds came from where the iterator
    started. Now a resume with workers, and a run without them, give the uninterrupted run's weights."""
    train(tmp_path / "whole", *data, "data.num_workers=2")
    assert_same_weights(tmp_path / "whole" / "model.pt", resumed(tmp_path / "resumed", *data, "data.num_workers=2"))
    train(tmp_path / "in-process", *data, "data.num_workers=0")  # dropout's draws are not shifted by the items'
    assert_same_weights(tmp_path / "whole" / "model.pt", tmp_path / "in-process" / "model.pt")


def test_an_item_is_the_same_whatever_the_batch_it_is_fetched_in():
    """Item 5 of epoch 1 is made under its own seed: alone, in a batch, after others; and the process's
    own generators are left as they were."""
    from tests.components import Augmented

    dataset = Augmented(64)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    alone = item_rng.made(dataset, [(1, 5)], torch.utils.data.default_collate, 0)
    among = item_rng.made(dataset, [(1, 9), (1, 5), (0, 5)], torch.utils.data.default_collate, 0)
    assert torch.equal(alone[0][0], among[0][1]) and not torch.equal(among[0][1], among[0][2])  # another epoch
    assert torch.equal(before[0], torch.get_rng_state()) and before[1] == random.getstate()
    assert (before[2] == np.random.get_state()[1]).all()
    other = item_rng.made(dataset, [(1, 5)], torch.utils.data.default_collate, 1)  # another recipe seed
    assert not torch.equal(alone[0][0], other[0][0])


@pytest.mark.slow
@pytest.mark.parametrize("target", ["Augmented", "AugmentedStream"], ids=["map-style", "stream"])
def test_augmented_items_are_the_same_under_ddp(tmp_path, target):
    """An item's draws do not depend on which rank makes it: ddp x2 gives the weights of one process. Neither
    launch is what is checked: the one process trains in this one, ddp x2 in the tests' pool of two ranks."""
    from tests.several_runs import several
    from tests.test_fsdp import here

    common = ["devices=cpu", "data.train.n=1024", "data.batch_size=32", "trainer.max_steps=40", "checkpoint.every=null",
              "logging.tensorboard=false", "logging.progress_bar=false", "logging.memory_plan=false", "data.val=null",
              f"data.train._target_=tests.components.{target}", *float64("recipes.components.mlp.MLP")]
    here(tmp_path / "one", "recipes/quickstart.yaml", *common)
    ranks = several({"ddp": ["recipes/quickstart.yaml", *common, "strategy=ddp", f"run_dir={tmp_path / 'two'}"]},
                    tmp_path)
    assert [rank["ddp"]["error"] for rank in ranks] == [None, None], ranks
    assert_within_rounding(tmp_path / "one" / "model.pt", tmp_path / "two" / "model.pt", steps=40)


if __name__ == "__main__":  # the cost of seeding one item: python -m tests.test_item_rng
    import timeit

    n = 100_000
    seconds = timeit.timeit(lambda: item_rng.seed(item_rng.key(0, 3, 12345)), number=n)
    kept = timeit.timeit(lambda: item_rng.Kept().back(), number=n // 10)
    print(f"seeding torch, random and numpy for one item: {seconds / n * 1e6:.1f} us; "
          f"keeping the process's generators around one batch made in it: {kept / (n // 10) * 1e6:.1f} us")
    sys.exit(0)
