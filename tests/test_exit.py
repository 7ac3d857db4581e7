"""How `python -m launcher` ends a run that ended (finished, or stopped by a mistake): every exit handler
runs (a library's, multiprocessing's, which ends the loader's workers), then the process leaves without
the interpreter tearing torch's modules down one by one (0.7 s of a one-step run's 3 s)."""

import subprocess
import time

import pytest

from tests.conftest import SMALL, launch


def _left(run_dir) -> list:
    """Processes still running whose command line names the run folder (a DataLoader worker's is its parent's)."""
    found = subprocess.run(["pgrep", "-f", f"run_dir={run_dir}"], capture_output=True, text=True).stdout.split()
    return [pid for pid in found if pid.isdigit()]


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_a_finished_run_runs_its_exit_handlers_and_leaves_no_loader_worker_behind(tmp_path):
    marker, run_dir = tmp_path / "marker", tmp_path / "run"
    model = f"model={{_target_: tests.components.WritesAtExit, marker: '{marker}', in_dim: 32, hidden: 128, classes: 10}}"
    done = launch("recipes/quickstart.yaml", *SMALL, "trainer.max_steps=40", "data.num_workers=2", model,
                  f"run_dir={run_dir}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.read_text() == "exit handlers ran"
    assert "done: step 40" in done.stderr + done.stdout
    for _ in range(20):  # a worker may take a moment to see its parent gone
        if not _left(run_dir):
            break
        time.sleep(0.1)
    assert _left(run_dir) == []


def test_a_mistake_runs_the_exit_handlers_too(tmp_path):
    marker = tmp_path / "marker"
    model = f"model={{_target_: tests.components.WritesAtExit, marker: '{marker}', in_dim: 16, hidden: 128, classes: 10}}"
    done = launch("recipes/quickstart.yaml", *SMALL, model, f"run_dir={tmp_path / 'run'}")
    assert done.returncode == 2 and "data.train does not fit the model" in done.stderr, done.stderr[-2000:]
    assert marker.read_text() == "exit handlers ran"


@pytest.mark.parametrize("train_data", ["blobs", "stream"])
def test_the_loader_workers_end_with_the_run_not_with_the_garbage_collector(tmp_path, train_data):
    """Persistent workers (training and validation) are stopped when the run ends. Left to the garbage
    collector, a loader in a reference cycle had its queues closed before its workers were told to stop,
    and each was waited for 5 s and killed: 10 s at the end of every DDP run with workers."""
    import multiprocessing

    from tests.conftest import train

    assert multiprocessing.active_children() == []
    stream = ["data.train._target_=recipes.components.synthetic.ResumableBlobStream"] if train_data == "stream" else []
    train(tmp_path, "trainer.max_steps=40", "data.num_workers=2", "trainer.eval_every=20", *stream)
    assert multiprocessing.active_children() == []


def test_torchruns_error_file_is_whole_or_absent_when_a_rank_is_stopped_while_writing_it(tmp_path, monkeypatch):
    """torchrun stops the other ranks as soon as one exits and reads each one's error file: a file left empty
    by a rank stopped mid-write made torchrun's own report fail on json, exit 1 instead of the ranks' 2."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from launcher import report

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # what a signal's handler does to the rank between opening and writing

    with monkeypatch.context() as m:
        m.setattr(report.json, "dump", stopped)
        with pytest.raises(KeyboardInterrupt):
            report.for_torchrun(["launcher: a mistake"])
    assert not path.exists()
    report.for_torchrun(["launcher: a mistake"])
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))  # as torchrun reads it
    assert failure.message["message"] == "launcher: a mistake" and failure.timestamp > 0


@pytest.mark.parametrize("rank0_said_it", [True, False])
def test_a_mistake_rank_0_never_met_is_said_by_the_rank_that_met_it(tmp_path, monkeypatch, capsys, rank0_said_it):
    """Under torchrun a rank leaves a mistake to rank 0, which meets the same recipe. A mistake that only this
    rank met (rank 0 waits for it in a collective) went unsaid: torchrun then stopped rank 0, and the run ended
    with exit 2 and no line. Once rank 0's error file has not come in its time, this rank says it."""
    from launcher import report
    from launcher.errors import UserError

    mine, theirs = tmp_path / "attempt_0" / "1" / "error.json", tmp_path / "attempt_0" / "0" / "error.json"
    mine.parent.mkdir(parents=True)
    theirs.parent.mkdir()
    if rank0_said_it:
        theirs.write_text("{}")  # rank 0's error file: written once its line is printed
    for var, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x",
                       "TORCHELASTIC_ERROR_FILE": str(mine)}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(report, "RANK0_GRACE", 0.2)
    report.mistake(UserError("parallel.pp: a mistake"))
    said = capsys.readouterr().err
    if rank0_said_it:
        assert said == "" and "rank 0 reports the mistake" in mine.read_text()
    else:
        assert said == "[rank 1] launcher: parallel.pp: a mistake\n"
        assert "launcher: parallel.pp: a mistake" in mine.read_text()
