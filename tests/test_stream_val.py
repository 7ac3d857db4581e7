"""A streamed validation set over several data-parallel ranks: every rank runs as many forwards, every item of the
stream is counted once, and the validation loss is one process's.

A rank whose share of the stream ended a batch earlier left the evaluation while the others ran a forward whose
collectives (fsdp's all-gathers) waited for it until dist_timeout (exit 6)."""

import json

import pytest
import torch

from tests.pace import paced
from tests.rounding import float64
from tests.test_strategies import RECIPE

# One global batch of 32 items and one more item: rank 0 of two holds it, rank 1's share ends a batch earlier.
VAL = [*RECIPE, *float64("recipes.components.mlp.MLP"), "trainer.max_steps=4", "checkpoint.every=null",
       "logging.jsonl=true", "data.val={_target_: recipes.components.synthetic.BlobStream, n: 33, spread: 3.0, "
       "split: 1}"]
FSDP = ["strategy=fsdp", "nproc_per_node=2", f"dist_timeout={round(paced(30))}"]  # a busy machine's healthy waits: longer


class _Numbers(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _evaluated(n, replicas, workers, batch_size=8):
    """Each rank's validation batches of a stream of the numbers 0..n-1: lists of items, or ('padding', items)."""
    from launcher.data.sampling import Padding
    from launcher.data.stream import StreamBatches

    ranks = []
    for rank in range(replicas):
        val = StreamBatches(_Numbers(n), batch_size, replicas, rank, workers, torch.device("cpu"), list,
                            lambda batch, device: batch)
        ranks.append([("padding", b.batch) if isinstance(b, Padding) else b for b in val])
    return ranks


@pytest.mark.parametrize("n, replicas, workers", [(1, 2, 0), (5, 2, 0), (9, 2, 0), (17, 4, 0), (19, 4, 0),
                                                  (32, 4, 0), (33, 2, 2), (12, 4, 2)])
def test_every_rank_runs_as_many_validation_batches_and_counts_each_item_once(n, replicas, workers):
    """Global batches of 8: a rank whose share of the last, incomplete one is empty (9 items over 2 ranks: rank 1;
    19 over 4: rank 3) runs a padding batch of one item, which evaluation does not count."""
    ranks = _evaluated(n, replicas, workers)
    assert len({len(batches) for batches in ranks}) == 1, ranks
    counted = sorted(item for batches in ranks for batch in batches if not isinstance(batch, tuple) for item in batch)
    assert counted == list(range(n)), ranks
    padding = [batch for batches in ranks for batch in batches if isinstance(batch, tuple)]
    assert all(len(items) == 1 for _, items in padding), padding


def test_a_stream_of_whole_global_batches_needs_no_padding():
    assert not any(isinstance(b, tuple) for batches in _evaluated(32, 4, 0) for b in batches)


def test_an_hf_stream_of_uneven_files_is_interleaved_for_validation():
    """An HF stream of two files, 5 items and 4, over two ranks: split by its hook, each rank read one file (rank
    0 two batches of 4, rank 1 one). Validation interleaves it as any stream: the items of one process's global
    batches, each once, and as many batches on both ranks."""
    datasets = pytest.importorskip("datasets", reason="the dev extra (datasets) is not installed")
    from launcher.data.sampling import Padding
    from launcher.data.stream import StreamBatches

    stream = datasets.Dataset.from_dict({"x": list(range(9))}).to_iterable_dataset(num_shards=2)
    ranks = []
    for rank in range(2):
        val = StreamBatches(stream, 8, 2, rank, 0, torch.device("cpu"), list, lambda batch, device: batch)
        ranks.append([None if isinstance(b, Padding) else [int(item["x"]) for item in b] for b in val])
    assert ranks == [[[0, 2, 4, 6], [8]], [[1, 3, 5, 7], None]]


def test_the_validation_loss_is_the_same_however_its_items_are_batched():
    """Summed in float32, a float64 model's validation loss depended on how its items were batched (ranks, padding)
    at float32's rounding; summed in float64, every split gives one process's value within float64's."""
    from launcher.model.step import Result
    from launcher.run.metrics import evaluate

    losses = torch.rand(33, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3

    def val_loss(*batches):
        results = lambda model, batch: [(Result(batch.mean(), None, None, None), batch)]  # noqa: E731
        return evaluate(torch.nn.Linear(1, 1), batches, results, {}, lambda sums: sums, torch.device("cpu"))["val/loss"]

    assert val_loss(losses[:16], losses[16:32], losses[32:]) == pytest.approx(val_loss(losses), rel=1e-14, abs=0)
    assert val_loss(*losses.split(5)) == pytest.approx(val_loss(losses[:32], losses[32:]), rel=1e-14, abs=0)


def _val_loss(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["val/loss"] for line in lines if "val/loss" in line]


@pytest.mark.slow  # a real torchrun launch of two processes
def test_fsdp_over_two_ranks_evaluates_an_uneven_stream_as_one_process(tmp_path):
    """fsdp x2 (gloo), with 0 and 2 loader workers a rank: the runs end (they waited in the evaluation until
    dist_timeout before), and their validation loss over the 33 items is one process's."""
    from tests.conftest import trained_here
    from tests.several_runs import several

    cases = {f"workers-{w}": [*VAL, *FSDP, f"data.num_workers={w}", f"run_dir={tmp_path / f'workers-{w}'}"]
             for w in (0, 2)}
    ranks = several(cases, tmp_path, timeout=400)
    trained_here(*VAL, "strategy=single", f"run_dir={tmp_path / 'one'}")
    alone = _val_loss(tmp_path / "one")
    for name in cases:
        assert [rank[name]["error"] for rank in ranks] == [None, None], [rank[name] for rank in ranks]
        ours = _val_loss(tmp_path / name)
        assert len(ours) == len(alone) == 1 and ours[0] == pytest.approx(alone[0], rel=1e-12), (name, ours, alone)

