"""Streams (IterableDataset) as data: each rank and worker its share, the same batches as the map-style
data they stream, and a resume that ends bitwise equal to an uninterrupted run."""

import pytest
import torch

from launcher.errors import UserError
from tests.conftest import assert_same_weights, train
from tests.test_loop import stop_after

STREAM = "data.train._target_=recipes.components.synthetic.BlobStream"
RESUMABLE = "data.train._target_=recipes.components.synthetic.ResumableBlobStream"


def test_a_stream_trains_the_weights_of_the_map_style_data_it_streams(tmp_path):
    """BlobStream hands out Blobs' items in DistributedSampler's order of each epoch (80 steps of 32 cross
    two epochs of 1024 items), so a stream and the map-style dataset give the same weights."""
    train(tmp_path / "map")
    train(tmp_path / "stream", STREAM, "data.val._target_=recipes.components.synthetic.BlobStream")
    assert_same_weights(tmp_path / "map" / "model.pt", tmp_path / "stream" / "model.pt")


def test_loader_workers_share_a_stream_in_its_order(tmp_path):
    train(tmp_path / "one", RESUMABLE)
    train(tmp_path / "workers", RESUMABLE, "data.num_workers=2")
    assert_same_weights(tmp_path / "one" / "model.pt", tmp_path / "workers" / "model.pt")


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", [RESUMABLE, STREAM], ids=["state_dict", "fast-forward"])
def test_a_stream_resumed_mid_epoch_is_bitwise_exact(tmp_path, capsys, kind, workers):
    extra = [kind, f"data.num_workers={workers}", "trainer.grad_accum_steps=2"]
    train(tmp_path / "whole", *extra)
    broken = tmp_path / "broken"
    train(broken, "checkpoint.every=15", "checkpoint.keep=10", *extra)
    stop_after(broken, 45)  # step 45 of 80: 90 micro-batches of 32, in the middle of the third epoch of 1024
    capsys.readouterr()
    train(broken, *extra)
    said = capsys.readouterr().out
    assert_same_weights(tmp_path / "whole" / "model.pt", broken / "model.pt")
    saved = torch.load(broken / "checkpoints" / "step_45" / "state.pt", weights_only=True)["stream"]
    assert saved[0]["batches"] == 90 and saved[0]["epoch"] == 2 and saved[0]["batch"] == 26, saved
    skipping = "has no state_dict(); its stream is read again from the start of epoch 2 and the 26 batches done are skipped"
    assert (skipping in said) == (kind == STREAM), said


def test_max_epochs_with_a_stream_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^trainer.max_epochs: data.train is a stream \(BlobStream.*set "
                                        r"trainer.max_steps and trainer.max_epochs=null"):
        train(tmp_path, STREAM, "trainer.max_epochs=2")


def test_a_stream_shorter_than_one_batch_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^data.train: the stream ends after 20 items, fewer than one batch "
                                        r"\(data.batch_size 32\)"):
        train(tmp_path, STREAM, "data.train.n=20")


def test_an_iterable_that_is_no_dataset_says_how_to_stream_it(tmp_path):
    with pytest.raises(UserError, match=r"^data.train: .* nor a stream .*subclass torch.utils.data.IterableDataset"):
        train(tmp_path, "data.train._target_=tests.components.JustIterable")


def test_a_stream_with_a_len_is_read_as_a_stream(tmp_path, capsys):
    values = train(tmp_path, "data.train={_target_: tests.components.SizedStream, n: 1024}", "data.val=null")
    assert values["train/loss"] >= 0 and "from a stream" in capsys.readouterr().out


class _Numbers(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_ranks_drop_the_epoch_s_last_incomplete_global_batch_alike(replicas):
    """19 items in global batches of 4: every rank hands out the 4 whole ones and drops the last three items, so no
    rank runs a batch more than another (rank 0 of two held two of those three, a whole share, and ran it alone)."""
    import itertools

    from launcher.data.stream import START, Share

    per_rank = []
    for rank in range(replicas):
        share = Share(_Numbers(19), "data.train", 4, replicas, rank)
        per_rank.append([batch for _, batch in itertools.islice(share.batches(START, 0, 1, list), 6)])
    for step in range(6):  # 4 global batches of epoch 0, then epoch 1's first two
        assert sorted(item for batches in per_rank for item in batches[step]) == [*range(4 * (step % 4),
                                                                                          4 * (step % 4) + 4)], step
