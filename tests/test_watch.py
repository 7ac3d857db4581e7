"""The recipe's recording windows (a profiler trace, CUDA memory snapshots) and the out-of-memory exit."""

import json
import re

import pytest
import torch

from launcher.errors import EXIT_OOM
from tests.conftest import assert_same_weights, launch, train, trained_here

MLP = "in_dim: 32, hidden: 128, classes: 10"


def test_a_profile_window_writes_one_trace_of_its_steps(tmp_path):
    train(tmp_path, "profile.at_step=3", "profile.steps=2", "trainer.max_steps=10")
    (trace,) = (tmp_path / "profile").iterdir()
    assert trace.name.startswith("rank0.") and trace.name.endswith(".pt.trace.json")  # torch's own naming
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    steps = {name for name in names if name.startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4"}  # the two steps, by their numbers in the run
    assert "aten::addmm" in names  # the model's matmuls, with their shapes
    assert any(e.get("name") == "aten::addmm" and "Input Dims" in e.get("args", {}) for e in events)


def test_no_window_no_profile_and_the_same_weights(tmp_path):
    train(tmp_path / "plain")
    train(tmp_path / "profiled", "profile.at_step=1", "profile.steps=80")  # a window over the whole run
    assert not (tmp_path / "plain" / "profile").exists()
    assert len(list((tmp_path / "profiled" / "profile").iterdir())) == 1
    assert_same_weights(tmp_path / "plain" / "model.pt", tmp_path / "profiled" / "model.pt")


def profiled_steps(trace):
    return sorted(int(e["name"].split("#")[1]) for e in json.loads(trace.read_text())["traceEvents"]
                  if e.get("name", "").startswith("ProfilerStep#"))


def test_a_window_the_run_ends_inside_is_written(tmp_path):
    train(tmp_path, "profile.at_step=79", "profile.steps=5")  # the run ends at step 80
    (trace,) = (tmp_path / "profile").iterdir()
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "aten::addmm" in names
    assert profiled_steps(trace) == [79, 80]  # nothing after the last step


def test_a_resumed_run_records_what_it_makes_of_a_window_and_says_what_it_cannot(tmp_path, capsys):
    train(tmp_path, "trainer.max_steps=20", "checkpoint.every=20")
    train(tmp_path, "trainer.max_steps=40", "profile.at_step=20", "profile.steps=3")  # resumes at step 20
    (trace,) = (tmp_path / "profile").iterdir()
    assert profiled_steps(trace) == [21, 22]
    assert "profile: steps 21-22 of rank 0 in" in capsys.readouterr().out

    train(tmp_path, "trainer.max_steps=60", "profile.at_step=10", "profile.steps=3")  # resumes at step 40
    train(tmp_path, "trainer.max_steps=80", "profile.at_step=500")
    out = capsys.readouterr().out
    assert "profile: steps 10-12 are not among this run's steps 41-60; nothing is recorded" in out
    assert "profile: steps 500-502 are not among this run's steps 61-80; nothing is recorded" in out
    assert len(list((tmp_path / "profile").iterdir())) == 1


def test_a_memory_snapshot_on_the_cpu_says_it_records_nothing(tmp_path, capsys):
    train(tmp_path, "memory_snapshot.at_step=2")
    assert "memory_snapshot: records CUDA's allocator; this run is on cpu, so nothing is recorded" in capsys.readouterr().out
    assert not (tmp_path / "memory").exists()


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_bad_windows_are_one_line_each(tmp_path):
    done = launch("recipes/quickstart.yaml", f"run_dir={tmp_path}", "profile.at_step=0", "profile.ranks=[]",
                  "memory_snapshot.steps=0")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert "profile.at_step" in lines[0] or any("profile.at_step" in l for l in lines)
    assert any("profile.ranks: must be a non-empty list of global ranks" in l for l in lines)
    assert any("memory_snapshot.steps" in l for l in lines)
    done = launch("recipes/quickstart.yaml", f"run_dir={tmp_path}", "profile.at_step=2", "profile.ranks=[1]",
                  "trainer.max_steps=3")
    assert done.returncode == 2
    assert done.stderr.strip() == "launcher: profile.ranks: [1] not below the world size 1; valid: 0..0"


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_out_of_memory_is_one_line_exit_5_and_the_checkpoint_stays(tmp_path):
    """A real allocator failure (16 TiB asked of the CPU) in step 25; checkpoints every 10 steps."""
    run_dir = tmp_path / "run"
    common = ["recipes/quickstart.yaml", f"run_dir={run_dir}", "data.train.n=1024", "data.val.n=256",
              "data.batch_size=32", "trainer.max_steps=40", "trainer.log_every=10", "checkpoint.every=10",
              "logging.tensorboard=false", "logging.memory_plan=false"]
    done = launch(*common, f"model={{_target_: tests.components.OutOfMemoryAt, at: 25, {MLP}}}")
    assert done.returncode == EXIT_OOM == 5, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert re.match(r"launcher: out of memory in step 25 on cpu \(peak resident \d+\.\d\d GiB\)\. HINT: lower "
                    r"data\.batch_size", line), line
    assert "Traceback" not in done.stdout + done.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_20"
    assert not (run_dir / "model.pt").exists()

    # the same run without the fault resumes from step 20 and finishes (what it reads is checked, not its process:
    # it and the run no fault stopped train in this one)
    said = trained_here(*common)
    assert "resumed from" in said and "(step 20," in said, said
    trained_here(*common[:1], f"run_dir={tmp_path / 'whole'}", *common[2:])
    assert_same_weights(tmp_path / "whole" / "model.pt", run_dir / "model.pt")
