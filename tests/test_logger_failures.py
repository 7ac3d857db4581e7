"""A logger that fails after the start costs a line, not the run: opened again where it can be (a deleted
folder made again), otherwise dropped, and training goes on."""

import re

from launcher.loggers import Loggers
from tests.conftest import train


def test_a_deleted_tensorboard_folder_is_made_again_and_the_run_ends(tmp_path, capsys):
    """It ended the run with exit 2 and no save (and a hint about disk space)."""
    folder = tmp_path / "tensorboard"
    train(tmp_path, "logging.tensorboard=true", "trainer.max_steps=60", "trainer.log_every=5",
          f"model={{_target_: tests.components.Deletes, path: '{folder}', at: 23}}")
    out = capsys.readouterr().out
    again = re.findall(rf"^logging.tensorboard: cannot write {folder}: No such file or directory \(errno 2\); opened "
                       rf"it again at step (\d+) \(a new event file in {folder}\)$", out, re.M)
    assert len(again) == 1 and 25 <= int(again[0]) <= 60, out
    assert (tmp_path / "model.pt").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = EventAccumulator(str(folder)).Reload()
    steps = [e.step for e in logged.Scalars("train/loss")]
    assert steps[-1] == 60 and int(again[0]) in steps, steps


class Failing:
    key = "mlflow"

    def __init__(self):
        self.closed = None

    def scalars(self, values, step):
        raise ConnectionError("HTTPConnectionPool(host='tracker', port=5000): Max retries exceeded\nmore detail")

    def close(self, status):
        self.closed = status


class Keeping:
    key = "jsonl"

    def __init__(self):
        self.got = []

    def scalars(self, values, step):
        self.got.append(step)

    def close(self, status):
        return None


def test_a_backend_that_cannot_be_opened_again_is_dropped_and_the_others_go_on():
    failing, keeping, said = Failing(), Keeping(), []
    loggers = Loggers([failing, keeping])
    loggers.say = said.append
    for step in (10, 20):
        loggers.scalars({"train/loss": 1.0}, step)
    loggers.close("finished")
    assert said == ["logging.mlflow: HTTPConnectionPool(host='tracker', port=5000): Max retries exceeded; dropped at "
                    "step 10, training goes on without it"]
    assert keeping.got == [10, 20] and failing.closed == "failed" and loggers.backends == [keeping]


def test_an_error_after_the_first_step_saves_the_last_whole_step_first(tmp_path, capsys):
    """A bug met at step 40's evaluation (a metric's, called once by the check before training and once a
    step) used to end the run with its last checkpoint at step 20:
    now step 40 is saved before the traceback, the run says where it resumes, and the resumed run (the
    metric mended) ends bitwise equal to one that never failed."""
    import pytest

    from tests.conftest import assert_same_weights

    common = ["checkpoint.every=20", "trainer.eval_every=40", "data.val.n=64"]
    with pytest.raises(ZeroDivisionError):
        train(tmp_path / "broken", *common, "metrics.accuracy={_target_: tests.components.BreaksAt, at: 42}")
    out = capsys.readouterr().out
    assert f"the newest checkpoint is {tmp_path / 'broken' / 'checkpoints' / 'step_40'}: the same command resumes " \
           f"from step 40" in out, out[-2000:]
    train(tmp_path / "broken", *common, "metrics.accuracy={_target_: tests.components.BreaksAt, at: 0}")
    train(tmp_path / "whole", *common, "metrics.accuracy={_target_: tests.components.BreaksAt, at: 0}")
    assert_same_weights(tmp_path / "whole" / "model.pt", tmp_path / "broken" / "model.pt")
