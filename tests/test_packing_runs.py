"""Packed rows through whole runs (tests/packed.yaml: a tiny Llama on tests/packed_tokens.py): under fsdp x2
(torchrun, gloo) and with the batch in two micro-batches the weights end within rounding of one process's
(rows hold different numbers of label tokens: the loss is the mean over the global batch's tokens); a run
resumed mid-epoch from its checkpoint, with two loader workers a rank, ends bitwise as the run that went
through. Both two-process runs share one torchrun launch (tests/several_runs.py)."""

import pytest
import torch

from tests.conftest import REPO
from tests.rounding import assert_within_rounding

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
pytestmark = pytest.mark.slow

RECIPE = REPO / "tests" / "packed.yaml"
FSDP = ["strategy=fsdp", "data.num_workers=2"]
MID_EPOCH = 12  # of 18 steps an epoch; the run goes on to step 24, into the second epoch
STEPS = 24


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """fsdp x2 through 24 steps, then the same resumed from its step 12: (root folder, rank 0's results)."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("packed")
    cases = {"whole": [RECIPE, f"run_dir={root / 'whole'}", *FSDP],
             "resumed": [RECIPE, f"run_dir={root / 'resumed'}", *FSDP,
                         f"checkpoint.resume={root / 'whole' / 'checkpoints' / f'step_{MID_EPOCH}'}"]}
    return root, several(cases, root)[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The run in this process (transformers is imported already): its final weights."""
    folder = tmp_path_factory.mktemp("packed-one")
    in_process(folder)
    return weights(folder / "model.pt")


def in_process(folder, *overrides):
    from launcher.recipe import load
    from launcher.run.train import train

    train(load(RECIPE, [f"run_dir={folder}", "checkpoint.every=null", *overrides]))


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_packed_rows_under_fsdp_x2_end_as_one_process(one_process, two_processes):
    root, results = two_processes
    assert results["whole"]["error"] is None, results["whole"]
    assert_within_rounding(one_process, weights(root / "whole" / "model.pt"), STEPS)


def test_packed_rows_in_two_micro_batches_end_as_in_one(tmp_path, one_process):
    in_process(tmp_path, "trainer.grad_accum_steps=2", "data.batch_size=4")
    assert_within_rounding(one_process, weights(tmp_path / "model.pt"), STEPS)


def test_packed_rows_resumed_mid_epoch_with_workers_end_bitwise_as_the_run_that_went_through(two_processes):
    root, results = two_processes
    assert results["resumed"]["error"] is None, results["resumed"]
    assert f"resumed from {root / 'whole' / 'checkpoints' / f'step_{MID_EPOCH}'}" in results["resumed"]["said"]
    whole, resumed = weights(root / "whole" / "model.pt"), weights(root / "resumed" / "model.pt")
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key
