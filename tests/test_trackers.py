"""Every logger at once, read back with each tool's own reader: MLflow's MlflowClient on a local file
store, W&B's offline transaction log through wandb's protobuf records, TensorBoard's EventAccumulator,
metrics.jsonl as JSON. A resumed run continues one tracker run with each step logged once."""

import json
import shutil
import struct

import pytest

from tests.conftest import launch, train
from tests.pace import paced

mlflow = pytest.importorskip("mlflow", reason="the dev extra installs mlflow-skinny")
wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="the dev extra installs wandb")


def every_logger(tmp_path):
    return ["logging.tensorboard=true", "logging.jsonl=true", f"logging.mlflow.tracking_uri=file:{tmp_path / 'mlruns'}",
            "logging.mlflow.experiment=trackers", "logging.wandb.mode=offline", "logging.wandb.group=lr-sweep",
            "trainer.eval_every=20",
            "trainer.max_steps=60"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")  # whatever the recipe says, no test reaches the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # nor writes outside its temporary folder
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    # wandb.init in this process (an in-process test before) saves its service's address in WANDB_SERVICE,
    # and a launched run would inherit it and share that service, where a killed run's id stays in use
    monkeypatch.delenv("WANDB_SERVICE", raising=False)


def client(tmp_path):
    uri = f"file:{tmp_path / 'mlruns'}"
    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)


def wandb_records(path):
    """The records of a .wandb file: LevelDB's log format (32 KiB blocks of crc, length, type, data)
    after W&B's 7-byte header, each a wandb_internal_pb2.Record."""
    data, out, pending, pos, block = path.read_bytes(), [], b"", 7, 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    for raw in out:
        record = wandb_pb.Record()
        record.ParseFromString(raw)
        yield record


def wandb_history(run_dir):
    """{offline run folder: [(step, {tag: value})]} and the run ids seen."""
    runs, ids = {}, set()
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        rows = runs.setdefault(path.parent.name, [])
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                values = {key: value for key, value in items.items() if not key.startswith("_")}
                rows.append((record.history.step.num, values))
    return runs, ids


def jsonl(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_logger_at_once(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, *every_logger(tmp_path))

    lines = jsonl(run_dir)
    assert [line["step"] for line in lines] == [10, 20, 30, 40, 50, 60]
    assert {"train/loss", "train/lr", "train/accuracy", "train/grad_norm", "time"} <= lines[0].keys()
    assert "val/loss" in lines[1] and "val/loss" not in lines[0]  # train and val of a step: one object
    config = json.loads((run_dir / "config.json").read_text())  # beside it, the recipe and what ran
    assert config["strategy"] == "auto" and config["optimizer"]["lr"] == 0.001
    assert config["effective"] == {"strategy": "single", "world_size": 1, "device": "cpu", "precision": "fp32",
                                   "grad_accum_steps": 1, "batch_size_per_rank": config["data"]["batch_size"],
                                   "total_steps": 60}

    ids = json.loads((run_dir / "trackers.json").read_text())
    c = client(tmp_path)
    run = c.get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert c.get_experiment(run.info.experiment_id).name == "trackers"
    assert [m.step for m in c.get_metric_history(run.info.run_id, "train/loss")] == [10, 20, 30, 40, 50, 60]
    assert [m.value for m in c.get_metric_history(run.info.run_id, "val/loss")] == \
        [line["val/loss"] for line in lines if "val/loss" in line]
    params = run.data.params
    assert params["optimizer.lr"] == "0.001" and params["model"] == "recipes.components.mlp.MLP"
    # what actually ran, beside what was asked
    assert params["strategy"] == "auto" and params["effective.strategy"] == "single"
    assert params["effective.world_size"] == "1" and params["effective.device"] == "cpu"
    assert params["effective.precision"] == "fp32"
    artifact = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="recipe.yaml",
                                                   tracking_uri=f"file:{tmp_path / 'mlruns'}", dst_path=str(tmp_path))
    assert "name: quickstart" in open(artifact).read()

    runs, wandb_ids = wandb_history(run_dir)
    assert wandb_ids == {ids["wandb"]["id"]} and len(runs) == 1
    (rows,) = runs.values()
    assert [step for step, _ in rows] == [10, 20, 30, 40, 50, 60]
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    groups = {r.run.run_group for path in folder.glob("run-*.wandb") for r in wandb_records(path)
              if r.WhichOneof("record_type") == "run"}
    assert groups == {"lr-sweep"}  # logging.wandb.group: what a sweep sets to its name
    kept = [r.config for path in folder.glob("run-*.wandb") for r in wandb_records(path)
            if r.WhichOneof("record_type") == "config"]
    values = {u.key: json.loads(u.value_json) for c in kept for u in c.update}
    assert values["effective"]["strategy"] == "single" and values["effective"]["world_size"] == 1
    assert values["strategy"] == "auto" and values["optimizer"]["lr"] == 0.001
    assert [values["train/loss"] for _, values in rows] == [line["train/loss"] for line in lines]


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_a_run_started_again_within_the_second_sorts_its_event_file_last(tmp_path):
    """TensorBoard reads event files in the order of their names (second, host, pid, an unpadded count):
    a resume within the second of the last file could sort first (.10 < .9), and its purge of the steps
    it logs again came before them (seen: a resumed run in the same process read [50, ..., 80, 10, ...])."""
    import time

    folder = tmp_path / "tensorboard"
    folder.mkdir()
    earlier = folder / f"events.out.tfevents.{int(time.time()) + 3}.vm.1.9"  # as if the clock were behind
    earlier.write_bytes(b"")
    train(tmp_path, "logging.tensorboard=true", "trainer.max_steps=10")
    assert sorted(p.name for p in folder.iterdir())[0] == earlier.name


def test_tensorboard_hparams_say_what_ran(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    train(tmp_path, "logging.tensorboard=true")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    start = plugin_data_pb2.HParamsPluginData.FromString(events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["strategy"].string_value == "auto" and hparams["effective.strategy"].string_value == "single"
    assert hparams["effective.world_size"].number_value == 1 and hparams["effective.device"].string_value == "cpu"
    ran = events.Tensors("effective/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "strategy: single" in ran and "world_size: 1" in ran and "precision: fp32" in ran


def test_a_resumed_run_continues_one_tracker_run_each_step_once(tmp_path):
    """Killed after step 60 was logged, with step 40 the newest checkpoint: the rerun resumes at 40, logs
    50 and 60 again where it owns the files (TensorBoard purges, jsonl drops lines) and continues the
    same MLflow and W&B runs without sending a step twice."""
    run_dir = tmp_path / "run"
    overrides = [*every_logger(tmp_path), "checkpoint.every=40", "trainer.max_steps=80"]
    train(run_dir, *overrides[:-1], "trainer.max_steps=60")  # the first attempt, as far as it got
    shutil.rmtree(run_dir / "checkpoints" / "step_60")  # ... its newest checkpoint is step 40's
    (run_dir / "model.pt").unlink()
    (run_dir / "checkpoints" / "latest").write_text("step_40")
    first = {line["step"]: line for line in jsonl(run_dir)}

    train(run_dir, *overrides)

    lines = jsonl(run_dir)
    assert [line["step"] for line in lines] == [10, 20, 30, 40, 50, 60, 70, 80]
    for step in (50, 60):  # exact resume: the same values as the first attempt's
        assert lines[step // 10 - 1]["train/loss"] == first[step]["train/loss"]

    ids = json.loads((run_dir / "trackers.json").read_text())
    c = client(tmp_path)
    (run,) = c.search_runs([c.get_experiment_by_name("trackers").experiment_id])
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.status == "FINISHED"
    assert [m.step for m in c.get_metric_history(run.info.run_id, "train/loss")] == [10, 20, 30, 40, 50, 60, 70, 80]
    assert [m.step for m in c.get_metric_history(run.info.run_id, "val/loss")] == [20, 40, 60, 80]

    runs, wandb_ids = wandb_history(run_dir)
    assert wandb_ids == {ids["wandb"]["id"]} and len(runs) == 2  # two attempts, one W&B run
    steps = [step for rows in runs.values() for step, _ in rows]
    assert steps == [10, 20, 30, 40, 50, 60, 70, 80]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [10, 20, 30, 40, 50, 60, 70, 80]


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_run_killed_with_values_in_flight_loses_none_on_resume(tmp_path):
    """kill -9 after step 45 was logged, with step 40 the newest checkpoint. What the trackers hold is what
    their own stores say, not what was handed to them: the rerun sends 45 again (W&B, whose process had
    not written it, and MLflow, if its sending thread had not), and every store ends with every step."""
    run_dir = tmp_path / "run"
    common = ["recipes/quickstart.yaml", f"run_dir={run_dir}", *every_logger(tmp_path)[:-2], "trainer.max_steps=60",
              "trainer.log_every=5", "trainer.eval_every=20", "checkpoint.every=20", "data.train.n=1024",
              "data.val.n=256", "logging.memory_plan=false",
              f"model={{_target_: tests.components.KilledOnce, at: 48, marker: {tmp_path / 'killed'}, "
              f"in_dim: 32, hidden: 128, classes: 10}}"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}
    killed = launch(*common, env=env)
    assert killed.returncode == -9, killed.stderr
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"]["held"] == 0  # wandb never finished
    resumed = launch(*common, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "(step 40," in resumed.stdout

    every = list(range(5, 65, 5))
    assert [line["step"] for line in jsonl(run_dir)] == every
    ids = json.loads((run_dir / "trackers.json").read_text())
    c = client(tmp_path)
    assert [m.step for m in c.get_metric_history(ids["mlflow"]["run_id"], "train/loss")] == every
    runs, wandb_ids = wandb_history(run_dir)
    assert wandb_ids <= {ids["wandb"]["id"]} and len(runs) == 2
    last = max(runs, key=lambda folder: [step for step, _ in runs[folder]])
    assert [step for step, _ in runs[last]] == [45, 50, 55, 60]  # from the checkpoint on: nothing skipped
    assert ids["wandb"]["held"] == 60


def test_starting_over_starts_new_tracker_runs(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, *every_logger(tmp_path))
    first = json.loads((run_dir / "trackers.json").read_text())
    train(run_dir, *every_logger(tmp_path), "checkpoint.resume=never")
    second = json.loads((run_dir / "trackers.json").read_text())
    assert second["mlflow"]["run_id"] != first["mlflow"]["run_id"] and second["wandb"]["id"] != first["wandb"]["id"]
    assert [line["step"] for line in jsonl(run_dir)] == [10, 20, 30, 40, 50, 60]


@pytest.mark.parametrize("section, package", [("mlflow", "mlflow-skinny"), ("wandb", "wandb")])
def test_a_missing_package_names_the_install_command(tmp_path, section, package):
    """A sitecustomize hides the package (import fails), as on a machine without the extra."""
    hide = tmp_path / "hide"
    hide.mkdir()
    module = "mlflow" if section == "mlflow" else "wandb"
    (hide / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    done = launch("recipes/quickstart.yaml", f"run_dir={tmp_path / 'run'}", f"logging.{section}={{}}",
                  "trainer.max_steps=2", env={"PYTHONPATH": str(hide)})
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"launcher: logging.{section}: the {package} package is not installed")
    assert f"pip install 'launcher[{section}]'" in line and f"logging.{section}=null" in line


def test_wandb_mode_is_checked(tmp_path):
    done = launch("recipes/quickstart.yaml", f"run_dir={tmp_path}", "logging.wandb.mode=onlin")
    assert done.returncode == 2
    assert "logging.wandb.mode: got 'onlin'; valid: online, offline" in done.stderr


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_tracking_server_that_cannot_be_reached_is_one_line_at_the_start(tmp_path):
    """MLflow retries for about four minutes; at the start the launcher asks it for two retries."""
    done = launch("recipes/quickstart.yaml", f"run_dir={tmp_path / 'run'}", "logging.mlflow.tracking_uri=http://127.0.0.1:1",
                  "trainer.max_steps=2", timeout=90)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("launcher: logging.mlflow: http://127.0.0.1:1: cannot be reached ([Errno 111] Connection "
                           "refused); check logging.mlflow.tracking_uri"), line


def test_the_loop_never_waits_on_the_tracking_server():
    """A server that does not answer: the calls queue on the sender's thread, the end of the run waits a
    bounded time and says what it leaves, and a call that failed costs one line."""
    import threading

    from launcher.loggers.mlflow import Sender

    said, gate = [], threading.Event()
    sender = Sender(said.append)
    for step in range(5):
        sender.send(f"step {step}", gate.wait)  # returns at once: the first call blocks the thread
    sender.finish(0.2)
    assert said == ["logging.mlflow: the tracking server did not take the last 5 calls within 0.2 s; they are left out"]

    gate.set()
    sender.finish(10)
    del said[:]

    def refused(*args):
        raise ConnectionError("HTTPConnectionPool: Max retries exceeded ([Errno 111] Connection refused)")

    sender.send("step 10", refused)
    sender.send("step 20", refused)
    sender.finish(10)
    assert said == ["logging.mlflow: could not log step 10 (cannot be reached ([Errno 111] Connection refused)); "
                    "training goes on, and values that cannot be logged are left out"]


# Runs of one experiment started at once: each process starts the MLflow logger of a run in each of 8 experiments
# in turn, after both are ready (a file each, then a spin), so that their lookups and creations interleave.
SIDE_BY_SIDE = """
import os, sys, time, types
from pathlib import Path

import mlflow  # noqa: F401  (imported before the start, not inside the race)
from launcher.loggers import Start
from launcher.loggers.mlflow import MLflow

uri, folder, me, other = sys.argv[1:]
Path(folder, me).touch()
while not Path(folder, other).exists():
    pass
for i in range(8):
    logger = MLflow(types.SimpleNamespace(tracking_uri=uri, experiment=f"grid{i}", run_name=me))
    logger.start(Start(Path(folder), "grid", 0, "", {}, {}, [], say=print))
    logger.close("finished")
"""


@pytest.mark.slow  # two processes
def test_runs_started_side_by_side_share_their_new_experiment(tmp_path):
    """Two processes, as `launcher.sweep --parallel 2` starts runs: each experiment is made once and holds both
    runs (before, the second run to create one ended with MLflow's "Experiment 'grid' already exists", or the
    file store held two experiments of one name)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    uri = f"file:{tmp_path / 'mlruns'}"
    procs = [subprocess.Popen([sys.executable, "-c", SIDE_BY_SIDE, uri, str(tmp_path), me, other], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for me, other in (("a", "b"), ("b", "a"))]
    outputs = [p.communicate(timeout=paced(120))[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    c = client(tmp_path)
    for i in range(8):
        (experiment,) = c.search_experiments(filter_string=f"name = 'grid{i}'")
        runs = c.search_runs([experiment.experiment_id])
        assert sorted(r.info.run_name for r in runs) == ["a", "b"], i


def test_an_experiment_created_between_the_lookup_and_the_creation_is_taken(tmp_path, monkeypatch):
    """The race made certain in one process: another run creates the experiment just after this one looked."""
    from pathlib import Path
    from types import SimpleNamespace

    from launcher.loggers import Start
    from launcher.loggers.mlflow import MLflow

    uri = f"file:{tmp_path / 'mlruns'}"
    lookup = mlflow.MlflowClient.get_experiment_by_name
    created = []

    def looked_too_early(self, name):
        found = lookup(self, name)
        if found is None and not created:
            created.append(mlflow.MlflowClient(tracking_uri=uri).create_experiment(name))  # the other run's
        return found

    monkeypatch.setattr(mlflow.MlflowClient, "get_experiment_by_name", looked_too_early)
    logger = MLflow(SimpleNamespace(tracking_uri=uri, experiment="grid", run_name="b"))
    kept = logger.start(Start(Path(tmp_path), "grid", 0, "", {}, {}, [], say=print))
    logger.close("finished")
    assert created and client(tmp_path).get_run(kept["run_id"]).info.experiment_id == created[0]
