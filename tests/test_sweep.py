"""python -m launcher.sweep on this machine: the grid (Hydra's syntax), every mistake of every combination at once
before anything starts, runs queued one or two at a time, a failed run in the table with its exit code, a
sweep started again skipping what is done, and Ctrl-C saving every running run for the same command to resume."""

import json
import signal
import subprocess
import sys
import time

import pytest

from launcher.errors import UserError
from launcher.sweep import folder, grid
from launcher.sweep.__main__ import main
from tests.conftest import QUICKSTART, REPO, SMALL, assert_same_weights
from tests.pace import paced, until
from tests.s3 import BUCKET, s3  # noqa: F401


def test_the_grid_in_hydra_s_syntax():
    axes, plain = grid.split(["optimizer.lr=0.001,0.01", "seed=range(0,3)", "trainer.max_steps=10",
                              "model.name='a,b'", "data.val=null", "model.sizes=[1,2],[3,4]"])
    assert axes == {"optimizer.lr": ["0.001", "0.01"], "seed": ["0", "1", "2"], "model.sizes": ["[1,2]", "[3,4]"]}
    assert plain == ["trainer.max_steps=10", "model.name='a,b'", "data.val=null"]
    runs = grid.runs({"optimizer.lr": ["0.001", "0.01"], "seed": ["0", "1"]})
    assert [r.name for r in runs] == ["lr=0.001,seed=0", "lr=0.001,seed=1", "lr=0.01,seed=0", "lr=0.01,seed=1"]
    assert runs[1].overrides == ["optimizer.lr=0.001", "seed=1"]
    two = grid.runs({"model.lr": ["1"], "optimizer.lr": ["2", "3"]})[0]  # last parts alike: whole keys
    assert two.name == "model.lr=1,optimizer.lr=2"
    odd = grid.runs({"model.sizes": ["[1,2]", "[3,4]"]})  # a folder name cannot hold brackets: a stable id
    assert odd[0].name.startswith("run-") and odd[0].name != odd[1].name
    assert grid.runs({"model.sizes": ["[1,2]"]})[0].name == odd[0].name
    assert grid.split(["seed=range(1,8,3)"])[0] == {"seed": ["1", "4", "7"]}
    with pytest.raises(UserError, match="seed: swept twice"):
        grid.split(["seed=1,2", "seed=3,4"])
    assert grid.split(["seed=range(3)"])[0] == {"seed": ["0", "1", "2"]}  # range(stop), as Python's
    for args, says in ((["seed=range(5,1)"], r"seed=range\(5,1\): the range holds no value"),
                       (["seed=range(a)"], r"seed=range\(a\): a range takes integers"),
                       (["seed=1,2", "seed=3"], r"seed: swept \(seed=1,2\) and set for every run \(seed=3\); give it once")):
        with pytest.raises(UserError, match=says):
            grid.split(args)


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_every_mistake_of_every_combination_at_once_and_nothing_starts(tmp_path, capsys):
    code = main([str(QUICKSTART), "trainer.max_steps=10,abc", "trainer.max_stepz=5", f"run_dir={tmp_path / 's'}",
                 "optimizer.lr=0.1,abc", "seed=range(0,30)"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and lines == [
        "launcher: 120 runs (2 x 2 x 30) are more than --max-runs 100; add --yes to start them all, or sweep fewer "
        "values",
        "launcher: override 'trainer.max_stepz=5': trainer.max_stepz: unknown key; did you mean 'trainer.max_steps'?",
        "launcher: override 'optimizer.lr=abc': optimizer.lr: 'torch.optim.AdamW' takes a number for 'lr' (its "
        "default: 0.001), got the string 'abc'",
        "launcher: override 'trainer.max_steps=abc': trainer.max_steps: expected an integer or null, got 'abc'"], lines
    assert not (tmp_path / "s").exists()
    assert main([str(QUICKSTART), "trainer.max_steps=10"]) == 2
    assert "no key is swept" in capsys.readouterr().err
    assert main([str(QUICKSTART), "seed=1,2", "--paralel", "2"]) == 2
    assert "unknown option --paralel" in capsys.readouterr().err
    assert main([str(QUICKSTART), "seed=1,2", "--max-parallel", "2"]) == 2  # a Slurm array's, without --slurm
    assert "--max-parallel: with --slurm (a job array's tasks at once); on this machine, --parallel N" in capsys.readouterr().err


def test_a_stray_comma_or_a_value_given_twice_is_one_line_each_before_anything_starts(tmp_path, capsys):
    """`lr=0.1,,0.2` made a run of a null lr that passed the check and failed after the others trained;
    `seed=3,3` made two runs of one folder (the second refused by the lock, the table two `done` rows).
    Hydra's grammar refuses an empty element; it runs a repeated value twice, each job in a numbered folder:
    here a run's folder is named by its values, so two runs of one folder (or of one recipe, spelt two ways)
    are a mistake."""
    with pytest.raises(UserError) as caught:
        grid.split(["optimizer.lr=0.1,,0.2", "data.val.n=,", "seed=3,3,4", "model.hidden=8,", "trainer.max_steps=10"])
    assert caught.value.problems == [
        "optimizer.lr=0.1,,0.2: an empty value between commas (a stray comma?); to sweep an empty string, quote "
        "it: ''",
        "data.val.n=,: an empty value between commas (a stray comma?); to sweep an empty string, quote it: ''",
        "seed=3,3,4: 3 is given 2 times; each value is one run in a folder of its own, so give it once",
        "model.hidden=8,: an empty value between commas (a stray comma?); to sweep an empty string, quote it: ''"]
    assert grid.split(["model.name='',a", "data.val=", "optimizer.lr=0.1,1e-1"])[0] == {
        "model.name": ["''", "a"], "optimizer.lr": ["0.1", "1e-1"]}  # quoted empty: a value; `key=`: every run's
    for args, line in (
            (["optimizer.lr=0.1,,0.2"], "launcher: optimizer.lr=0.1,,0.2: an empty value between commas (a stray "
                                        "comma?); to sweep an empty string, quote it: ''"),
            (["optimizer.lr=,"], "launcher: optimizer.lr=,: an empty value between commas (a stray comma?); to "
                                 "sweep an empty string, quote it: ''"),
            (["optimizer.lr=0.1,0.1"], "launcher: optimizer.lr=0.1,0.1: 0.1 is given 2 times; each value is one "
                                       "run in a folder of its own, so give it once (to repeat a run, sweep its "
                                       "seed: seed=range(3))"),
            (["optimizer.lr=0.1,1e-1,0.2", "seed=0,1"],  # two folders, one recipe: one line for the two values
             "launcher: optimizer.lr=0.1 and optimizer.lr=1e-1: the same run twice (one recipe in the folders "
             "lr=0.1,seed=0/ and lr=1e-1,seed=0/); give each value once (to repeat a run, sweep its seed: "
             "seed=range(3))"),
            (["seed=3,03"], "launcher: seed=3 and seed=03: the same run twice (one recipe in the folders seed=3/ "
                            "and seed=03/); give each value once")):
        assert main([str(QUICKSTART), *args, f"run_dir={tmp_path / 's'}", "--dry-run"]) == 2
        assert capsys.readouterr().err.splitlines() == [line]
        assert not (tmp_path / "s").exists()
    assert main([str(QUICKSTART), "seed=3,3", f"run_dir={tmp_path / 's'}"]) == 2  # without --dry-run: nothing trains
    assert capsys.readouterr().err.splitlines() == [
        "launcher: seed=3,3: 3 is given 2 times; each value is one run in a folder of its own, so give it once"]
    assert not (tmp_path / "s").exists()


def sweep_here(capsys, *args) -> subprocess.CompletedProcess:
    """python -m launcher.sweep ARGS run in this process (torch imported once; its runs are processes of their own,
    as ever), for a sweep whose own process is not what a test checks: its exit code, stdout and stderr."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.mark.slow
def test_a_sweep_runs_each_combination_reports_a_failure_and_skips_what_is_done(tmp_path, monkeypatch, capsys,
                                                                                  s3):  # noqa: F811
    """Two runs at once: one diverges (exit 3), one finishes; the table says so, MLflow holds both under the
    sweep's name; started again, the finished run is skipped and the failed one runs again. Their checkpoints
    go to an object store (tests/s3.py), each run's below the recipe's checkpoint.dir."""
    uri = f"file:{tmp_path / 'mlruns'}"
    args = [QUICKSTART, *SMALL, "trainer.max_steps=20", "model={_target_: tests.components.DivergesAt, at: 1000}",
            "model.at=5,1000", f"run_dir={tmp_path / 'grid'}", f"logging.mlflow={{tracking_uri: '{uri}'}}",
            f"checkpoint.dir=s3://{BUCKET}/grid", "--parallel", "2"]
    done = sweep_here(capsys, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    table = done.stdout.splitlines()[-3:]
    assert table[0].split() == ["model.at", "status", "step", "train/loss", "val/accuracy", "val/loss", "time"], done.stdout
    assert table[1].split()[:3] == ["5", "failed", "(exit"] and table[2].split()[:3] == ["1000", "done", "20/20"]
    assert "the training loss is nan at step 5" in (tmp_path / "grid" / "at=5" / "output.log").read_text()
    again = sweep_here(capsys, *args)
    assert "2 runs in" in again.stdout and "1 done already" in again.stdout and "at=1000 started" not in again.stdout
    assert s3.objects("grid") == [f"at=1000/step_20/{f}" for f in ("manifest.json", "model.pt", "state.pt")]
    from launcher.sweep import report  # read from the run folders, wherever their checkpoints are

    assert [row["status"] for row in report.rows(folder.read(tmp_path / "grid"))] == ["failed (exit 3)", "done"]

    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("grid").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["at=1000", "at=5", "at=5"]  # at=5 tried twice


@pytest.mark.slow
def test_ctrl_c_saves_every_running_run_and_the_same_command_resumes_them(tmp_path, capsys):
    slow = [*SMALL, "model={_target_: tests.components.Slow, seconds: 0.02}", "trainer.max_steps=150",
            "trainer.log_every=10"]
    args = [QUICKSTART, *slow, "seed=1,2", f"run_dir={tmp_path / 'grid'}", "--parallel", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "launcher.sweep", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = [tmp_path / "grid" / f"seed={s}" / "output.log" for s in (1, 2)]
    deadline = until(120)
    while not all(p.exists() and "step 20/" in p.read_text() for p in logs):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=paced(120))
    assert proc.returncode == 130, out
    assert "stopped by SIGINT; the same command resumes the runs" in out
    for s in (1, 2):
        assert "stopped at step" in out and (tmp_path / "grid" / f"seed={s}" / "checkpoints" / "latest").exists()
    done = sweep_here(capsys, *args)  # (the sweep stopped by SIGINT above is a process of its own)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(r["status"] == "done" for r in _rows(tmp_path / "grid"))
    alone = subprocess.run([sys.executable, "-m", "launcher", QUICKSTART, *slow, "seed=2", f"run_dir={tmp_path / 'alone'}"],
                           cwd=REPO, capture_output=True, text=True, timeout=paced(120))
    assert alone.returncode == 0, alone.stderr
    assert_same_weights(tmp_path / "alone" / "model.pt", tmp_path / "grid" / "seed=2" / "model.pt")
    assert json.loads((tmp_path / "grid" / "seed=2" / folder.EXIT).read_text())["exit_code"] == 0


def _rows(path):
    from launcher.sweep import report

    return report.rows(folder.read(path))


def test_each_run_of_a_queue_gets_gpus_of_its_own(monkeypatch):
    from launcher.sweep.local import gpu_groups

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert gpu_groups(1, 4, share=False) == ["[0]", "[1]", "[2]", "[3]"]
    assert gpu_groups(2, 2, share=False) == ["[0,1]", "[2,3]"]
    with pytest.raises(UserError, match="--parallel 3: 4 GPU"):
        gpu_groups(2, 3, share=False)
    assert gpu_groups(2, 3, share=True) == ["[0,1]", "[2,3]", "[0,1]"]
    with pytest.raises(UserError, match="--gpus-per-run 5: this machine shows 4 GPU"):
        gpu_groups(5, 1, share=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_groups(1, 2, share=False) == [None, None]  # no GPU: each run as its recipe says


def test_a_slurm_dry_run_prints_the_array_s_script_and_submits_nothing(tmp_path, capsys):
    assert main([str(QUICKSTART), "seed=1,2", f"run_dir={tmp_path / 's'}", "--slurm", "--max-parallel", "1",
                 "--time", "10", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-1%1" in out and "#SBATCH --time=10" in out and "#SBATCH --job-name=s" in out, out
    assert f"    1) RUN=(seed=2 run_dir={tmp_path / 's' / 'seed=2'} logging.jsonl=true)" in out, out
    assert not (tmp_path / "s").exists()
