"""Streams over several processes (torchrun, gloo): a global batch is the same items at any world size, a
run resumes bitwise at its world size and, re-reading its share, at another; a stream split by its own
hook (HF datasets) cannot change world size and says so."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_same_weights, in_this_process
from tests.test_strategies import EXACT, assert_equivalent, run

pytestmark = pytest.mark.slow  # real torchrun / multi-process runs

STREAM = "data.train._target_=recipes.components.synthetic.ResumableBlobStream"
DDP = ["strategy=ddp", "nproc_per_node=2"]


def launcher(*args):
    return [sys.executable, "-m", "launcher", *EXACT, *args]


def keep_until(run_dir, step):
    for folder in (run_dir / "checkpoints").iterdir():
        if folder.name.startswith("step_") and int(folder.name[5:]) > step:
            shutil.rmtree(folder)
    (run_dir / "model.pt").unlink()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream-one")
    code, out, err = in_this_process(*EXACT, f"run_dir={folder}", "strategy=single", STREAM)
    assert code == 0, out[-3000:] + err[-3000:]
    return folder / "model.pt"


def _hf_rows(folder):
    with open(folder / "rows.jsonl", "w") as f:
        for i in range(256):
            f.write(json.dumps({"text": f"row {i} " * (i % 7 + 2)}) + "\n")
    return [str(REPO / "recipes/hf_causal_lm.yaml"), "data.val=null", "trainer.max_steps=6", "checkpoint.every=3",
            "logging.tensorboard=false", "logging.progress_bar=false", "data.batch_size=8",
            f"data.train={{_target_: recipes.components.text_stream.text_stream, files: '{folder}/rows.jsonl', "
            f"cache_dir: '{folder}/hf-cache'}}", f"run_dir={folder / 'run'}"]


TP = ["strategy=fsdp", "nproc_per_node=2", "parallel.tp=2", "parallel.tp_plan={'0': colwise, '2': rowwise}"]
SAVING = ["checkpoint.every=15", "checkpoint.keep=5"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Every two-process run of these tests but accelerate's, none of which checks its launch: one torchrun
    launch trains them all (tests/several_runs.py), each as `python -m launcher` starts it under torchrun; the
    checkpoints after step 30 (3 of the HF stream's) are removed as a kill would leave them; one more launch
    resumes the two that resume on two ranks. The outcomes, by case: each rank's first and resumed results."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("stream-ranks")
    (root / "first").mkdir()
    (root / "again").mkdir()
    cases = {f"ddp {w} workers": launcher(f"run_dir={root / f'workers-{w}'}", *DDP, STREAM, f"data.num_workers={w}",
                                          *SAVING)[3:] for w in (0, 2)}
    cases["ddp, resumed on one"] = launcher(f"run_dir={root / 'on-one'}", *DDP, STREAM, *SAVING)[3:]
    cases["tp"] = launcher(f"run_dir={root / 'tp'}", *TP, STREAM, *SAVING)[3:]
    cases["fsdp"] = launcher("strategy=fsdp", STREAM, f"run_dir={root / 'fsdp'}")[3:]
    try:
        import datasets  # noqa: F401
        (root / "hf").mkdir()
        cases["hf"] = [*_hf_rows(root / "hf"), *DDP]
    except ImportError:  # the dev extra is not installed: its test skips
        pass
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAUNCHER_CACHE", str(root / "launcher-cache"))
        first = several(cases, root / "first")
        runs = {name: {"first": [rank[name] for rank in first]} for name in cases}
        for w in (0, 2):
            if runs[f"ddp {w} workers"]["first"][0]["error"] is None:
                shutil.copy(root / f"workers-{w}" / "model.pt", root / f"workers-{w}.pt")
                keep_until(root / f"workers-{w}", 30)  # the first epoch of 32 steps, mid-way
        for name in ("ddp, resumed on one", "tp"):
            if runs[name]["first"][0]["error"] is None:
                shutil.copy(_run_dir(cases[name]) / "model.pt", root / f"{_run_dir(cases[name]).name}.pt")
                keep_until(_run_dir(cases[name]), 30)
        if "hf" in cases and runs["hf"]["first"][0]["error"] is None:
            keep_until(root / "hf" / "run", 3)
        again = several({f"ddp {w} workers": cases[f"ddp {w} workers"] for w in (0, 2)}, root / "again")
    for w in (0, 2):
        runs[f"ddp {w} workers"]["again"] = [rank[f"ddp {w} workers"] for rank in again]
    return root, cases, runs


def _run_dir(args):
    return Path(next(a for a in args if a.startswith("run_dir="))[len("run_dir="):])


def _fine(results):
    assert [rank["error"] for rank in results] == [None] * len(results), results


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_read_the_global_batches_of_one_and_resume_exactly(two_process_runs, one_process, workers):
    """Two ranks (with 0 or 2 loader workers each) end as one process without workers does; killed mid-epoch
    (its checkpoints after step 30 gone), the run resumes and ends bitwise as it did."""
    root, _, runs = two_process_runs
    run = runs[f"ddp {workers} workers"]
    _fine(run["first"])
    whole, broken = root / f"workers-{workers}.pt", root / f"workers-{workers}"
    assert_equivalent(one_process, whole)
    _fine(run["again"])
    said = "".join(rank["said"] for rank in run["again"])
    assert "read again" not in said and "skipped" not in said, said
    assert_same_weights(whole, broken / "model.pt")


def test_a_stream_written_by_two_ranks_resumes_on_one(two_process_runs):
    root, _, runs = two_process_runs
    _fine(runs["ddp, resumed on one"]["first"])
    code, said, err = in_this_process(*launcher(f"run_dir={root / 'on-one'}", "strategy=single", STREAM)[3:])
    assert code == 0, err[-3000:]
    assert ("data.train: the stream was read by 2 processes; 1 read it again from the start of epoch 0, skipping its "
            "30 global batches done") in said, said
    assert_equivalent(root / "on-one.pt", root / "on-one" / "model.pt")


def test_a_tensor_parallel_pair_reads_a_stream_as_one_rank_and_resumes_exactly_on_one(two_process_runs, one_process):
    """Two processes splitting the MLP's layers (tp 2) are one data-parallel rank: each reads every item of a
    batch, as one process does, and their checkpoint holds one place in the stream, which one process resumes
    exactly (no re-reading)."""
    root, _, runs = two_process_runs
    _fine(runs["tp"]["first"])
    assert_equivalent(one_process, root / "tp.pt")
    code, said, err = in_this_process(*launcher(f"run_dir={root / 'tp'}", "strategy=single", STREAM)[3:])
    assert code == 0, err[-3000:]
    assert "read it again" not in said and "resumed from" in said, said
    assert_equivalent(one_process, root / "tp" / "model.pt")


def test_an_hf_stream_split_over_two_ranks_refuses_one(two_process_runs):
    pytest.importorskip("datasets", reason="the dev extra (datasets) is not installed")
    root, cases, runs = two_process_runs
    _fine(runs["hf"]["first"])
    code, out, err = in_this_process(*[a for a in cases["hf"] if a not in DDP])
    assert code == 2, out + err
    assert ("checkpoint.resume: the checkpoint's stream was split by its own hook over 2 processes and cannot be "
            "resumed by 1; resume with 2, or start over with checkpoint.resume=never") in out + err


@pytest.mark.parametrize("how", ["fsdp", "accelerate"])
def test_fsdp_and_accelerate_read_a_stream_as_one_process_does(one_process, two_process_runs, tmp_path, how):
    from tests.test_strategies import ACCELERATE, free_port

    if how == "fsdp":  # under torchrun: the launch all the two-process runs share
        root, _, runs = two_process_runs
        _fine(runs["fsdp"]["first"])
        stdout, model = runs["fsdp"]["first"][0]["said"], root / "fsdp" / "model.pt"
    else:
        pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
        command = [*ACCELERATE, "--multi_gpu", "--num_processes=2", "--num_machines=1", "--mixed_precision=no",
                   "--dynamo_backend=no", f"--main_process_port={free_port()}", "-m", "launcher", *EXACT]
        stdout, model = run([*command, STREAM, f"run_dir={tmp_path}"]).stdout, tmp_path / "model.pt"
    assert f"({how})" in stdout and "from a stream" in stdout, stdout
    assert_equivalent(one_process, model)
