"""HF `datasets` in streaming mode, from JSON-lines files the test writes (no network), tokenized on the fly
by recipes/components/text_stream.py, through the shipped HF recipe: it trains, and a run killed mid-stream
resumes from the dataset's own state_dict() to the weights of an uninterrupted run."""

import json

import pytest
import torch

from tests.conftest import REPO, assert_same_weights
from tests.test_hf import train_here
from tests.test_loop import stop_after

pytest.importorskip("datasets", reason="the dev extra (datasets) is not installed")
pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """Two JSON-lines files of Hamlet's lines (two shards), and HF's caches inside tmp_path."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lines = [line for line in (REPO / "recipes/data/hamlet.txt").read_text().splitlines() if len(line.strip()) > 24]
    for part in range(2):
        with open(tmp_path / f"part{part}.jsonl", "w") as f:
            for line in lines[part * 400:(part + 1) * 400]:
                f.write(json.dumps({"text": line}) + "\n")
    return (f"data.train={{_target_: recipes.components.text_stream.text_stream, files: '{tmp_path}/part*.jsonl', "
            f"cache_dir: '{tmp_path}/hf-cache'}}")


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
@pytest.mark.parametrize("workers", [0, 2])
def test_an_hf_stream_of_local_files_trains_and_resumes_exactly(tmp_path, corpus, capsys, workers):
    # 30 steps of 16 rows x 2 micro-batches: 960 rows, past the first epoch of 800 (the second starts at step 25)
    extra = [corpus, "data.batch_size=16", "trainer.grad_accum_steps=2", "trainer.max_steps=30",
             f"data.num_workers={workers}"]
    values = train_here(tmp_path / "whole", *extra)
    assert values["train/loss"] < 5.0  # from ln(256) = 5.5
    broken = tmp_path / "broken"
    train_here(broken, "checkpoint.every=9", "checkpoint.keep=5", *extra)
    stop_after(broken, 27)  # in the second epoch
    capsys.readouterr()
    train_here(broken, *extra)
    said = capsys.readouterr().out
    assert "resumed from" in said and "skipped" not in said, said  # read on from the state, nothing skipped
    assert_same_weights(tmp_path / "whole" / "model.pt", broken / "model.pt")
    saved = torch.load(broken / "checkpoints" / "step_27" / "state.pt", weights_only=True)["stream"][0]
    assert saved["epoch"] == 1 and saved["dataset"]["epoch"] == 1, saved
