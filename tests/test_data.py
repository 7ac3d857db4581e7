"""The data path: batches fetched whole are the batches a per-item loader makes, in DESIGN's order."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset, default_collate

from launcher.data import collate
from launcher.data import sampling as data
from launcher.data import loaders
from recipes.components.chars import CharText
from recipes.components.synthetic import Blobs


def per_item_batches(dataset, per_rank, replicas, rank, epoch, seed=0):
    """What a hand-written loop gets: DistributedSampler's order, items stacked one by one."""
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return list(DataLoader(dataset, batch_size=per_rank, sampler=sampler, drop_last=True))


def stream(dataset, batch_size, replicas, rank, epochs):
    train = data.TrainData(dataset, batch_size, 1, replicas, rank, True, 0, 0, torch.device("cpu"))
    batches = train.stream(data.Position())
    return [next(batches) for _ in range(epochs * train.batches_per_epoch)], train


def assert_same_batches(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_a_tensor_dataset_is_fetched_whole_and_gives_the_per_item_batches():
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(100, 3, generator=g), torch.randint(0, 5, (100,), generator=g))
    for replicas, rank in ((1, 0), (2, 1)):
        ours, train = stream(dataset, 16, replicas, rank, epochs=2)
        assert isinstance(train.loader.dataset, data.TensorBatches)
        theirs = [b for epoch in range(2) for b in per_item_batches(dataset, 16 // replicas, replicas, rank, epoch)]
        assert_same_batches(ours, theirs[:len(ours)])


def test_shipped_datasets_fetch_whole_batches_equal_to_their_items():
    for dataset in (Blobs(n=64), CharText("recipes/data/hamlet.txt", block_size=32)):
        index = [3, 0, len(dataset) - 1, 3]
        whole = dataset.__getitems__(index)
        assert isinstance(whole, tuple)
        assert_same_batches([whole], [default_collate([dataset[i] for i in index])])
        assert all(t.is_contiguous() for t in whole)


class ListItems(Dataset):
    """torch's own protocol: __getitems__ returns a list of items, which the loader collates."""

    def __init__(self):
        self.asked = []

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i

    def __getitems__(self, indices):
        self.asked.append(list(indices))
        return [self[i] for i in indices]


def test_a_getitems_that_returns_a_list_is_collated():
    dataset = ListItems()
    ours, _ = stream(dataset, 4, 1, 0, epochs=1)
    assert dataset.asked and all(len(a) == 4 for a in dataset.asked)
    assert_same_batches(ours, per_item_batches(dataset, 4, 1, 0, epoch=0))


def test_collate_passes_a_whole_batch_through():
    batch = (torch.zeros(4, 2), torch.ones(4))
    assert collate.default(batch) is batch
    x, y = collate.default([(torch.zeros(2), 1), (torch.ones(2), 2)])
    assert x.shape == (2, 2) and y.tolist() == [1, 2]


def test_the_loader_options_reach_torch_s_dataloader():
    """data.num_workers, persistent_workers, prefetch_factor and pin_memory, as DataLoader takes them; the
    defaults: workers kept between epochs, torch's prefetch, page-locked batches only where they go to a GPU."""
    dataset = Blobs(n=256)
    cpu = torch.device("cpu")
    loader = data.TrainData(dataset, 32, 1, 1, 0, True, 0, 2, cpu).loader
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor, loader.pin_memory) == (2, True, 2, False)
    chosen = loaders.Loading(workers=2, persistent=False, prefetch=4, pin_memory=True)
    loader = data.TrainData(dataset, 32, 1, 1, 0, True, 0, chosen, cpu).loader
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor, loader.pin_memory) == (2, False, 4, True)
    assert loaders.Loading().options(torch.device("cuda")) == {"num_workers": 0, "pin_memory": True}
    for method in ("fork", "forkserver", "spawn"):  # data.multiprocessing_context, as the recipe names it
        loader = data.TrainData(dataset, 32, 1, 1, 0, True, 0, loaders.Loading(workers=2, start=method), cpu).loader
        assert loader.multiprocessing_context.get_start_method() == method


def test_a_batch_that_does_not_share_out_names_the_data_parallel_ranks():
    from launcher.errors import UserError

    data.check_batch(8, 4, 8)  # 4 data-parallel ranks of 8 processes under tp 2: 2 items each
    with pytest.raises(UserError, match=r"^data.batch_size: 6 does not divide among 4 data-parallel ranks \(8 processes "
                                        r"/ parallel.tp 2\); use a multiple of 4$"):
        data.check_batch(6, 4, 8)
    with pytest.raises(UserError, match=r"^data.batch_size: 3 does not divide among 2 processes; use a multiple of 2$"):
        data.check_batch(3, 2, 2)


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_in_a_process_group_workers_start_where_a_fork_cannot_hang(tmp_path):
    """In a process group on CPython before 3.12, loader workers are forked from a fork server, not from the
    rank beside gloo's threads (CPython gh-112275); they make the batches forked workers make, and a dataset
    that does not pickle is one line naming its key."""
    import torch.distributed as dist
    from launcher.errors import UserError

    cpu = torch.device("cpu")

    def batches(dataset):
        train = data.TrainData(dataset, 32, 1, 1, 0, True, 0, loaders.Loading(workers=2, persistent=False), cpu)
        try:
            return [b for _, b in zip(range(3), train.stream(data.Position()))], train.loader
        finally:
            train.close()

    assert "multiprocessing_context" not in loaders.Loading(workers=2).options(cpu)
    forked, _ = batches(Blobs(n=256))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        served, loader = batches(Blobs(n=256))
        method = loader.multiprocessing_context.get_start_method() if loader.multiprocessing_context else "fork"
        assert method == ("fork" if loaders.FORK_SAFE else "forkserver")
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(forked, served))
        unpicklable = Blobs(n=256)
        unpicklable.transform = lambda x: x
        if not loaders.FORK_SAFE:
            with pytest.raises(UserError, match=r"^data.train: its loader workers start from a fork server here "
                                                r"\(torch.distributed on Python 3.\d+, .*; make them picklable, or set "
                                                r"data.num_workers=0, or data.multiprocessing_context=fork"):
                batches(unpicklable)
        chosen = loaders.Loading(workers=2, persistent=False, start="spawn")
        with pytest.raises(UserError, match=r"^data.train: its loader workers start by spawn "
                                            r"\(data.multiprocessing_context\), so .* do not: .*lambda"):
            data.TrainData(unpicklable, 32, 1, 1, 0, True, 0, chosen, cpu).stream(data.Position()).__next__()
    finally:
        dist.destroy_process_group()
