"""Streams over several processes (torchrun, gloo): a global batch is the same items at any world size, a
run resumes bitwise at its world size and, re-reading its share, at another; a stream split by its own
hook (HF datasets) cannot change world size and says so."""

import json
import shutil
import sys

import pytest

from tests.conftest import REPO, assert_same_weights, launch
from tests.test_strategies import RECIPE, assert_equivalent, run

pytestmark = pytest.mark.slow  # real torchrun / multi-process runs

STREAM = "data.train._target_=recipes.components.synthetic.ResumableBlobStream"
DDP = ["strategy=ddp", "nproc_per_node=2"]


def launcher(*args):
    return [sys.executable, "-m", "launcher", *RECIPE, *args]


def keep_until(run_dir, step):
    for folder in (run_dir / "checkpoints").iterdir():
        if folder.name.startswith("step_") and int(folder.name[5:]) > step:
            shutil.rmtree(folder)
    (run_dir / "model.pt").unlink()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream-one")
    run(launcher(f"run_dir={folder}", "strategy=single", STREAM))
    return folder / "model.pt"


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_read_the_global_batches_of_one_and_resume_exactly(tmp_path, one_process, workers):
    """Two ranks (with 0 or 2 loader workers each) end as one process without workers does; killed mid-epoch
    (its checkpoints after step 30 gone), the run resumes and ends bitwise as it did."""
    extra = [STREAM, f"data.num_workers={workers}"]
    broken = tmp_path / "broken"
    run(launcher(f"run_dir={broken}", *DDP, *extra, "checkpoint.every=15", "checkpoint.keep=5"))
    whole = tmp_path / "whole.pt"
    shutil.copy(broken / "model.pt", whole)
    assert_equivalent(one_process, whole)
    keep_until(broken, 30)  # the first epoch of 32 steps, mid-way
    done = run(launcher(f"run_dir={broken}", *DDP, *extra))
    assert "read again" not in done.stdout and "skipped" not in done.stdout, done.stdout
    assert_same_weights(whole, broken / "model.pt")


def test_a_stream_written_by_two_ranks_resumes_on_one(tmp_path):
    run(launcher(f"run_dir={tmp_path}", *DDP, STREAM, "checkpoint.every=15", "checkpoint.keep=5"))
    whole = tmp_path.parent / (tmp_path.name + "-whole")
    shutil.copy(tmp_path / "model.pt", whole)
    keep_until(tmp_path, 30)
    done = run(launcher(f"run_dir={tmp_path}", "strategy=single", STREAM))
    assert ("data.train: the stream was read by 2 processes; 1 read it again from the start of epoch 0, skipping its "
            "30 global batches done") in done.stdout, done.stdout
    assert_equivalent(whole, tmp_path / "model.pt")


def test_a_tensor_parallel_pair_reads_a_stream_as_one_rank_and_resumes_exactly_on_one(tmp_path, one_process):
    """Two processes splitting the MLP's layers (tp 2) are one data-parallel rank: each reads every item of a
    batch, as one process does, and their checkpoint holds one place in the stream, which one process resumes
    exactly (no re-reading)."""
    tp = ["strategy=fsdp", "nproc_per_node=2", "parallel.tp=2", "parallel.tp_plan={'0': colwise, '2': rowwise}"]
    run(launcher(f"run_dir={tmp_path}", *tp, STREAM, "checkpoint.every=15", "checkpoint.keep=5"))
    assert_equivalent(one_process, tmp_path / "model.pt")
    keep_until(tmp_path, 30)
    done = run(launcher(f"run_dir={tmp_path}", "strategy=single", STREAM))
    assert "read it again" not in done.stdout and "resumed from" in done.stdout, done.stdout
    assert_equivalent(one_process, tmp_path / "model.pt")


def test_an_hf_stream_split_over_two_ranks_refuses_one(tmp_path):
    pytest.importorskip("datasets", reason="the dev extra (datasets) is not installed")
    with open(tmp_path / "rows.jsonl", "w") as f:
        for i in range(256):
            f.write(json.dumps({"text": f"row {i} " * (i % 7 + 2)}) + "\n")
    hf = [str(REPO / "recipes/hf_causal_lm.yaml"), "data.val=null", "trainer.max_steps=6", "checkpoint.every=3",
          "logging.tensorboard=false", "logging.progress_bar=false", "data.batch_size=8",
          f"data.train={{_target_: recipes.components.text_stream.text_stream, files: '{tmp_path}/rows.jsonl', "
          f"cache_dir: '{tmp_path}/hf-cache'}}", f"run_dir={tmp_path / 'run'}"]
    run([sys.executable, "-m", "launcher", *hf, *DDP])
    keep_until(tmp_path / "run", 3)
    done = launch(*hf)
    assert done.returncode == 2, done.stdout + done.stderr
    assert ("checkpoint.resume: the checkpoint's stream was split by its own hook over 2 processes and cannot be "
            "resumed by 1; resume with 2, or start over with checkpoint.resume=never") in done.stdout + done.stderr


@pytest.mark.parametrize("how", ["fsdp", "accelerate"])
def test_fsdp_and_accelerate_read_a_stream_as_one_process_does(one_process, tmp_path, how):
    from tests.test_strategies import ACCELERATE, TORCHRUN, free_port

    if how == "fsdp":
        command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "launcher", *RECIPE, "strategy=fsdp"]
    else:
        pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
        command = [*ACCELERATE, "--multi_gpu", "--num_processes=2", "--num_machines=1", "--mixed_precision=no",
                   "--dynamo_backend=no", f"--main_process_port={free_port()}", "-m", "launcher", *RECIPE]
    done = run([*command, STREAM, f"run_dir={tmp_path}"])
    assert f"({how})" in done.stdout and "from a stream" in done.stdout, done.stdout
    assert_equivalent(one_process, tmp_path / "model.pt")
