"""What a run shows: TensorBoard's event files, read back with TensorBoard's own reader, and the console."""

import os
import pty
import subprocess
import sys

import pytest

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from tests.conftest import REPO, launch, train
from tests.pace import paced


def test_tensorboard_scalars_recipe_and_hparams(tmp_path):
    train(tmp_path, "logging.tensorboard=true", "trainer.eval_every=40", "data.tokens_per_sample=32",
          "logging.peak_tflops=0.5")
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/samples_per_s", "train/tokens_per_s", "train/mfu",
                "train/accuracy", "train/grad_norm", "val/loss", "val/accuracy"}
    assert expected <= scalars, scalars
    assert [e.step for e in events.Scalars("train/loss")] == list(range(10, 81, 10))
    assert [e.step for e in events.Scalars("val/accuracy")] == [40, 80]
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses[-1] < losses[0]
    assert events.Scalars("train/lr")[0].value == pytest.approx(1e-3)  # stored as float32
    tps, sps = events.Scalars("train/tokens_per_s")[-1].value, events.Scalars("train/samples_per_s")[-1].value
    assert abs(tps - 32 * sps) < 1e-3 * tps
    flops = 6 * (32 * 128 + 128 * 128 + 128 * 10)  # the quickstart MLP's weights, 6 FLOPs each per sample
    assert events.Scalars("train/mfu")[-1].value == pytest.approx(sps * flops / 0.5e12, rel=1e-3)
    assert "train/max_memory_gib" not in scalars  # CUDA only

    text = events.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "name: quickstart" in text and "_target_: recipes.components.mlp.MLP" in text

    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["optimizer.lr"].number_value == 1e-3
    assert hparams["model"].string_value == "recipes.components.mlp.MLP"
    assert hparams["data.batch_size"].number_value == 32
    assert not [p for p in (tmp_path / "tensorboard").iterdir() if p.is_dir()]  # no stray sub-runs


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_console_lines_without_a_terminal(tmp_path):
    done = launch("recipes/quickstart.yaml", f"run_dir={tmp_path}", "trainer.max_steps=100",
                  "trainer.log_every=25", "logging.tensorboard=false")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    steps = [l for l in lines if l.startswith("step ")]
    assert [l.split()[1] for l in steps] == ["25/100", "50/100", "75/100", "100/100"]
    assert "| loss " in steps[0] and "| accuracy " in steps[0] and "samples/s" in steps[0]
    assert any(l.startswith("eval at step 100 | val/loss") for l in lines)
    final = lines[-1]
    assert final.startswith("done: step 100") and "val/accuracy" in final
    assert float(final.split("val/accuracy ")[1].split()[0]) > 0.5  # ten classes: chance is 0.1


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_progress_bar_on_a_terminal(tmp_path):
    """With stderr on a terminal, rank 0 draws a tqdm bar instead of printing step lines."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "recipes/quickstart.yaml", f"run_dir={tmp_path}",
         "trainer.max_steps=60", "logging.tensorboard=false"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    out, _ = proc.communicate(timeout=paced(60))
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0
    assert "60/60" in terminal and "step/s" in terminal and "loss" in terminal
    assert not any(l.startswith("step ") for l in (out + terminal).splitlines())


@pytest.mark.parametrize("columns", [40, 60, 80, 120, 200])
def test_the_bar_keeps_the_loss_and_metrics_and_fits_the_terminal(columns):
    from tqdm import tqdm

    from launcher.loggers import bar_values
    from launcher.loggers.console import BAR

    values = {"train/loss": 0.6416, "train/lr": 1e-3, "train/accuracy": 0.8859, "train/grad_norm": 1.138,
              "train/samples_per_s": 6360.0, "train/tokens_per_s": 407040.0}
    shown = bar_values(values, columns)
    line = tqdm.format_meter(120, 1000, 10.0, ncols=columns, unit="step", prefix=shown, bar_format=BAR)
    # first, so that the loss and metrics stay when a narrow terminal cuts the line (40 columns cut them)
    assert line.startswith("loss 0.6416 | accuracy 0.8859"), line
    assert len(line) <= columns
    if columns >= 80:  # what an 80-column terminal showed before: the bar cut after grad_norm
        assert line.endswith("]"), line
    if columns >= 200:
        assert "tokens/s 407,040" in line


def test_every_backend_is_a_field_of_logging_and_a_module_of_its_own():
    """A new backend is one file, one field of LoggingConfig and its name in BACKENDS: make() asks nothing else."""
    import dataclasses
    import importlib

    from launcher import loggers
    from launcher.recipe.schema import LoggingConfig

    fields = {f.name for f in dataclasses.fields(LoggingConfig)}
    assert set(loggers.BACKENDS) <= fields
    assert fields - set(loggers.BACKENDS) == {"progress_bar", "peak_tflops", "memory_plan"}  # settings, not backends
    for name in loggers.BACKENDS:
        module = importlib.import_module(f"launcher.loggers.{name}")
        assert callable(module.backend), name
