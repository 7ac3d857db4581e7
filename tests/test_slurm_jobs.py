"""The launcher on a real Slurm cluster (slurm/local/): submit, several nodes, preemption and requeue."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.recipe.schema import SlurmConfig
from launcher.slurm.render import render
from tests.conftest import REPO, assert_same_weights
from tests.pace import paced, until
from tests.s3 import BUCKET, s3  # noqa: F401
from tests.slurm_cluster import slurm_cluster  # noqa: F401
from tests.test_strategies import EXACT, RECIPE, assert_equivalent

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def submit(cluster, run_dir: Path, *args: str, env: dict = None, recipe: list = EXACT) -> int:
    """The job gets the environment it is submitted from (sbatch's --export=ALL): the cluster's, plus `env`."""
    done = subprocess.run([sys.executable, "-m", "launcher.slurm", "submit", *recipe, f"run_dir={run_dir}",
                           f"--python={sys.executable}", "--time=5", *args],
                          cwd=REPO, env={**cluster.env, **(env or {})}, capture_output=True, text=True, timeout=paced(60))
    assert done.returncode == 0, done.stderr
    match = re.fullmatch(r"submitted job (\d+): script (\S+), logs (\S+)\n", done.stdout)
    assert match and Path(match.group(2)) == run_dir / "slurm" / "job.sbatch", done.stdout
    return int(match.group(1))


def log(run_dir: Path, job: int) -> str:
    path = run_dir / "slurm" / f"{job}.out"
    return path.read_text() if path.exists() else ""


def finished(cluster, run_dir: Path, job: int, timeout: float = 150) -> str:
    info = cluster.wait(job, timeout=timeout)
    output = log(run_dir, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{output[-3000:]}"
    return output


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    done = subprocess.run([sys.executable, "-m", "launcher", *EXACT, f"run_dir={folder}"], cwd=REPO,
                          capture_output=True, text=True, timeout=paced(120))
    assert done.returncode == 0, done.stderr
    return folder / "model.pt"


def test_two_nodes_through_torchrun(slurm_cluster, tmp_path, single):  # noqa: F811
    job = submit(slurm_cluster, tmp_path, "--nodes=2")
    output = finished(slurm_cluster, tmp_path, job)
    assert "1     0           1" in output  # rank 1: local rank 0 on node 1
    assert (tmp_path / "recipe.yaml").exists() and (tmp_path / "checkpoints" / "latest").exists()
    assert_equivalent(single, tmp_path / "model.pt")


def test_two_nodes_through_srun_alone(slurm_cluster, tmp_path, single):  # noqa: F811
    job = submit(slurm_cluster, tmp_path, "--nodes=2", "--layout=srun")
    output = finished(slurm_cluster, tmp_path, job)
    assert "(ddp)" in output and "1     0           1" in output
    assert_equivalent(single, tmp_path / "model.pt")


def test_two_nodes_sharded_and_tensor_parallel(slurm_cluster, tmp_path, single):  # noqa: F811
    """Two nodes of two processes: the MLP's layers split over each node's pair (tp 2, intra-node), FSDP
    sharding over the nodes (dp_shard 2)."""
    job = submit(slurm_cluster, tmp_path, "--nodes=2", "--tasks-per-node=2", "strategy=fsdp", "parallel.tp=2",
                 "parallel.tp_plan={'0': colwise, '2': rowwise}")
    output = finished(slurm_cluster, tmp_path, job, timeout=240)
    assert "(fsdp)" in output and "3     1           1" in output  # rank 3: local rank 1 on node 1
    assert "fsdp: dp_shard 2 x tp 2 = 4 ranks" in output and "parallel.tp: 2 layers split over 2 ranks" in output
    assert (tmp_path / "checkpoints" / "step_40" / "__3_0.distcp").exists()  # rank 3 wrote its shards on node 1
    assert_equivalent(single, tmp_path / "model.pt")


def test_two_nodes_as_two_pipeline_stages(slurm_cluster, tmp_path):  # noqa: F811
    """charlm cut in two stages, one a node (1F1B): only activations and their gradients cross between the
    nodes; the job ends as one process does."""
    from tests.rounding import assert_within_rounding
    from tests.test_parallel import alone
    from tests.test_pipeline import GPT, SGD, STEPS

    alone(tmp_path / "one", *GPT, *SGD)
    job = submit(slurm_cluster, tmp_path / "pp", "--nodes=2", "strategy=fsdp", "parallel.pp=2", recipe=[*GPT, *SGD])
    output = finished(slurm_cluster, tmp_path / "pp", job, timeout=240)
    assert "1     0           1" in output  # rank 1 (the second stage): local rank 0 on node 1
    assert "parallel.pp: pp 2 x dp_shard 1 = 2 ranks; 2 stages (1f1b, 2 micro-batches)" in output
    assert_within_rounding(tmp_path / "one" / "model.pt", tmp_path / "pp" / "model.pt", STEPS)


def test_one_node_two_processes(slurm_cluster, tmp_path, single):  # noqa: F811
    job = submit(slurm_cluster, tmp_path, "--tasks-per-node=2")
    output = finished(slurm_cluster, tmp_path, job)
    assert "1     1           0" in output  # rank 1: local rank 1 on node 0
    assert_equivalent(single, tmp_path / "model.pt")


SLOW = ["model={_target_: tests.components.Slow, seconds: 0.02}", "trainer.max_steps=300", "checkpoint.every=null"]


@pytest.mark.parametrize("sharded", [False, True], ids=["one-process", "fsdp-x2"])
def test_preemption_saves_requeues_and_finishes_exactly(slurm_cluster, tmp_path, sharded, monkeypatch, request):  # noqa: F811
    """... and the requeued job continues the same MLflow run, each step logged once. fsdp x2 keeps its
    checkpoints in an object store (S3's API on this machine: tests/s3.py): the requeued job resumes from there."""
    fsdp = ["strategy=fsdp"] if sharded else []
    store = request.getfixturevalue("s3") if sharded else None
    url = f"s3://{BUCKET}/preempted"
    whole = subprocess.run([sys.executable, "-m", "launcher", *RECIPE, *SLOW, *fsdp, *(["nproc_per_node=2"] if sharded else []),
                            f"run_dir={tmp_path / 'whole'}"], cwd=REPO, capture_output=True, text=True, timeout=paced(180))
    assert whole.returncode == 0, whole.stderr
    run_dir = tmp_path / "preempted"
    tracked = [f"logging.mlflow.tracking_uri=file:{tmp_path / 'mlruns'}", "logging.jsonl=true"]
    elsewhere = [f"checkpoint.dir={url}"] if sharded else []
    job = submit(slurm_cluster, run_dir, *SLOW, *fsdp, *tracked, *elsewhere, *(["--tasks-per-node=2"] if sharded else []),
                 env=store.env if sharded else None, recipe=RECIPE)
    deadline = until(90)
    while "step 10/" not in log(run_dir, job):
        assert time.monotonic() < deadline, log(run_dir, job)
        time.sleep(0.2)
    slurm_cluster.run("scancel", "--signal=USR1", str(job))  # what Slurm sends before the time limit
    slurm_cluster.release(job, timeout=60)  # requeued: start it now instead of after Slurm's hold
    output = finished(slurm_cluster, run_dir, job)
    assert "stopped by SIGUSR1 after step" in output and f"requeued Slurm job {job}" in output, output
    assert "restart 1" in output and "resumed from" in output, output
    assert slurm_cluster.job_state(job)["Restarts"] == "1"
    assert_same_weights(tmp_path / "whole" / "model.pt", run_dir / "model.pt")
    if sharded:  # saved on SIGUSR1 and at the end into the store alone, resumed from there
        saved = re.search(rf"resumed from {url}/step_(\d+) ", output)
        assert saved and not (run_dir / "checkpoints").exists(), output
        held = store.objects("preempted")
        assert {key.split("/")[0] for key in held} == {f"step_{saved.group(1)}", "step_300"}, held
        assert all(f"step_{n}/{f}" in held for n in (saved.group(1), 300)
                   for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json")), held

    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [line["step"] for line in lines if "train/loss" in line]  # (saves log checkpoint/blocked_s at their steps)
    assert steps == logged and steps == sorted(set(steps)) and steps[-1] == 300, (steps, logged)


def test_a_sweep_as_a_job_array_requeues_a_preempted_task_and_each_ends_as_alone(slurm_cluster, tmp_path):  # noqa: F811
    """python -m launcher.sweep --slurm: one array of 4 tasks, 2 at a time; task 0 is preempted (SIGUSR1),
    saves, requeues itself and resumes; every run's weights are those of the same run trained alone."""
    from launcher.recipe import load
    from launcher.sweep import folder
    from launcher.run.train import train

    slow = [*SLOW, "trainer.max_steps=150"]
    grid = tmp_path / "grid"
    done = subprocess.run([sys.executable, "-m", "launcher.sweep", *RECIPE, *slow, "optimizer.lr=0.001,0.01",
                           "seed=1,2", f"run_dir={grid}", "--slurm", "--max-parallel", "2", f"--python={sys.executable}",
                           "--time=5"], cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=paced(120))
    assert done.returncode == 0, done.stderr
    job = re.fullmatch(r"submitted job array of 4 tasks, 2 at a time (\d+): script \S+, logs \S+\n", done.stdout)
    assert job, done.stdout
    job = job.group(1)
    first = grid / "slurm" / f"{job}_0.out"
    deadline = until(120)
    while "step 10/" not in (first.read_text() if first.exists() else ""):
        assert time.monotonic() < deadline, first.read_text() if first.exists() else "no log"
        time.sleep(0.2)
    # What Slurm sends before the time limit, to the training process (its pid is in its folder's lock).
    # Not through `scancel --signal`: for an array task it holds slurmctld until the task's own `scontrol
    # requeue` times out, then signals the requeued run again.
    holder = (sweep_run_dir(grid, 0) / ".lock").read_text()
    os.kill(int(re.match(r"pid (\d+)", holder).group(1)), signal.SIGUSR1)
    slurm_cluster.release(f"{job}_0", timeout=60)
    sweep = folder.read(grid)
    for run in sweep.runs:  # each run trained alone here, while the array's tasks run (they mostly wait)
        train(load(RECIPE[0], [*RECIPE[1:], *slow, *run.overrides, f"run_dir={tmp_path / 'alone' / run.name}"]))
    deadline = until(240)
    while not all(folder.status(sweep.run_dir(r)).state == "done" for r in sweep.runs):
        assert time.monotonic() < deadline, [folder.status(sweep.run_dir(r)).describe() for r in sweep.runs]
        time.sleep(1)
    said = first.read_text()
    assert f"requeued Slurm job {job}_0" in said and "resumed from" in said, said
    for run in sweep.runs:
        assert_same_weights(tmp_path / "alone" / run.name / "model.pt", sweep.run_dir(run) / "model.pt")


def sweep_run_dir(grid: Path, index: int) -> Path:
    from launcher.sweep import folder

    sweep = folder.read(grid)
    return sweep.run_dir(sweep.runs[index])


def test_a_bad_recipe_fails_within_seconds_with_one_line(slurm_cluster, tmp_path):  # noqa: F811
    # submit checks the recipe before sbatch; a script rendered by hand reaches the nodes as it is.
    script = tmp_path / "bad.sbatch"
    script.write_text(render(SlurmConfig(python=sys.executable, time="5"), REPO / "recipes" / "quickstart.yaml",
                             ["trainer.max_step=5"], tmp_path, "bad", REPO))
    (tmp_path / "slurm").mkdir()
    job = slurm_cluster.sbatch(script)
    info = slurm_cluster.wait(job, timeout=30)  # FAILED, not TIMEOUT at its 5 minutes, nor requeued
    assert info["JobState"] == "FAILED", info
    lines = [l for l in log(tmp_path, job).splitlines() if l.startswith("launcher: ") and "unknown key" in l]
    assert lines == ["launcher: override 'trainer.max_step=5': trainer.max_step: unknown key; "
                     "did you mean 'trainer.max_steps'?"]
