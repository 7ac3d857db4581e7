"""`python -m launcher.sweep report`: a sweep's runs in every state, read from folders written by hand (no training)."""

import csv
import io
import json
import subprocess
import sys
import time

import pytest

from launcher.errors import UserError
from launcher.sweep import report
from launcher.sweep.folder import Sweep, mark_exit
from launcher.sweep.grid import runs

AXES = {"optimizer.lr": ["0.1", "0.01"], "seed": ["1", "2", "3"]}
HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def fake_run(run_dir, lines, exit_code=None, seconds=None, total=100):
    """What a run leaves: config.json, metrics.jsonl and (once its process ended) sweep-exit.json."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"effective": {"total_steps": total}}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"time": 1.0, **line}) + "\n" for line in lines))
    if exit_code is not None:
        mark_exit(run_dir, exit_code, time.time() - seconds)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Six runs: two done, failed, stopped, running (a child holds its lock), not started."""
    folder = tmp_path_factory.mktemp("sweep")
    made = Sweep(folder, "recipes/quickstart.yaml", ["trainer.max_steps=100"], AXES, runs(AXES))
    made.write()
    done, done_too, failed, stopped, running, _ = (made.run_dir(run) for run in made.runs)
    fake_run(done, [{"step": 50, "train/loss": 1.0, "val/loss": 0.9, "val/accuracy": 0.7},
                    {"step": 100, "train/loss": 0.5, "val/loss": 0.6, "val/accuracy": 0.9}], 0, 184)
    fake_run(done_too, [{"step": 50, "train/loss": 0.8, "val/loss": 0.4, "val/accuracy": 0.85},
                        {"step": 100, "train/loss": 0.45678, "val/loss": 0.7, "val/accuracy": 0.75}], 0, 12)
    fake_run(failed, [{"step": s, "train/loss": 2.0 - s / 100} for s in (10, 20, 30)], 3, 3720)
    fake_run(stopped, [{"step": s, "train/loss": 1.5, "val/loss": 1.2} for s in (25, 50)], 0, 30)
    fake_run(running, [{"step": 40, "train/loss": 1.25}])
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(running / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        yield made
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_each_run_is_a_row_in_the_sweeps_order_with_its_state(sweep):
    table = report.rows(sweep)
    assert list(table[0]) == ["optimizer.lr", "seed", "status", "step", "train/loss", "val/accuracy", "val/loss", "time"]
    assert [(r["optimizer.lr"], r["seed"]) for r in table] == [(lr, seed) for lr in AXES["optimizer.lr"] for seed in AXES["seed"]]
    assert [(r["status"], r["step"], r["time"]) for r in table] == [
        ("done", "100/100", "3m04s"), ("done", "100/100", "12s"), ("failed (exit 3)", "30/100", "1h02m"),
        ("stopped at step 50", "50/100", "30s"), ("running", "40/100", "-"), ("not started", "-", "-")]


def test_final_values_have_four_decimals_and_a_dash_where_a_run_logged_none(sweep):
    table = report.rows(sweep)
    assert [r["train/loss"] for r in table] == ["0.5000", "0.4568", "1.7000", "1.5000", "1.2500", "-"]
    assert [r["val/loss"] for r in table] == ["0.6000", "0.7000", "-", "1.2000", "-", "-"]
    assert [r["val/accuracy"] for r in table] == ["0.9000", "0.7500", "-", "-", "-", "-"]


def test_best_is_the_minimum_over_the_whole_history_or_the_maximum(sweep):
    lowest = report.rows(sweep, best="val/loss")
    assert list(lowest[0])[-2:] == ["best val/loss", "time"]
    assert [r["best val/loss"] for r in lowest] == ["0.6000", "0.4000", "-", "1.2000", "-", "-"]  # 0.4 at step 50
    highest = report.rows(sweep, best="val/accuracy", maximize=True)
    assert [r["best val/accuracy"] for r in highest] == ["0.9000", "0.8500", "-", "-", "-", "-"]


def lines_of(capsys, *argv):
    assert report.main([str(a) for a in argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_the_table_marks_the_best_run(sweep, capsys):
    lines = lines_of(capsys, sweep.folder, "--best", "val/loss")
    assert lines[0].split() == ["optimizer.lr", "seed", "status", "step", "train/loss", "val/accuracy", "val/loss",
                                "best", "val/loss", "time"]
    assert [line.endswith("12s") for line in lines[1:]] == [False, True, False, False, False, False]
    assert [" 0.4000 * " in line for line in lines[1:]] == [False, True, False, False, False, False]
    assert lines[1].index("3m04s") == lines[0].index("time")  # aligned under its header
    lines = lines_of(capsys, sweep.folder, "--best", "val/accuracy", "--max")
    assert [" 0.9000 * " in line for line in lines[1:]] == [True, False, False, False, False, False]


def test_csv_reads_back_as_the_rows_without_the_mark(sweep, capsys):
    text = "\n".join(lines_of(capsys, sweep.folder, "--best", "val/loss", "--csv"))
    assert list(csv.DictReader(io.StringIO(text))) == report.rows(sweep, best="val/loss")
    assert "*" not in text


def test_markdown_is_a_pipe_table_with_the_mark(sweep, capsys):
    lines = lines_of(capsys, sweep.folder, "--best", "val/loss", "--markdown")
    assert len(lines) == 2 + len(sweep.runs)
    assert set(lines[1]) == {"|", "-"} and lines[1].count("|") == lines[0].count("|")
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines[:1] + lines[2:])
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0][:3] == ["optimizer.lr", "seed", "status"]
    assert [row[cells[0].index("best val/loss")] for row in cells[2:]] == ["0.6000", "0.4000 *", "-", "1.2000", "-", "-"]


def test_render_refuses_an_unknown_form():
    with pytest.raises(ValueError, match="html"):
        report.render([{"a": "1"}], "html")


def test_a_folder_that_is_not_a_sweeps_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not a sweep's folder"):
        report.main([str(tmp_path)])


def test_best_naming_a_key_no_run_logged_lists_the_keys_logged(sweep):
    with pytest.raises(UserError) as caught:
        report.main([str(sweep.folder), "--best", "val/los"])
    message = str(caught.value)
    assert "val/los:" in message and "train/loss, val/accuracy, val/loss" in message
