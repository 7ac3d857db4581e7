"""A logged training value is the mean over exactly the steps since the last log step, whenever the
checkpoints and evaluations of the run happen (they check for NaN and let the interval go on)."""

import json

import pytest

from tests.conftest import train


def logged(run_dir, key="train/loss"):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x[key] for x in lines if key in x}


def test_a_save_or_an_evaluation_between_log_steps_leaves_the_logged_means_alone(tmp_path):
    common = ["logging.jsonl=true", "trainer.max_steps=20", "trainer.log_every=10", "data.val.n=64"]
    train(tmp_path / "plain", *common)
    train(tmp_path / "saves", *common, "checkpoint.every=3")
    train(tmp_path / "evals", *common, "trainer.eval_every=3")
    train(tmp_path / "each", *common, "trainer.log_every=1")
    plain = logged(tmp_path / "plain")
    assert sorted(plain) == [10, 20]
    assert logged(tmp_path / "saves") == plain
    evals = logged(tmp_path / "evals")
    assert {step: evals[step] for step in plain} == plain  # evaluations log val/* at their own steps only
    assert sorted(logged(tmp_path / "evals", "val/loss")) == [3, 6, 9, 12, 15, 18, 20]
    each = logged(tmp_path / "each")
    for step in plain:  # the mean of the ten steps' own losses, as a one-step interval logs them
        assert plain[step] == pytest.approx(sum(each[s] for s in range(step - 9, step + 1)) / 10, rel=1e-6)
