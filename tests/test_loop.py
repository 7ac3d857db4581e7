"""The loop: exact resume, no host reads between log steps, accumulation, NaN, precision, stopping rules."""

import shutil
import sys

import pytest
import torch

from launcher.errors import TrainingDiverged, UserError
from tests.conftest import assert_same_weights, launch, state_dict, train
from tests.rounding import assert_within_rounding, float64

EXACT = float64("recipes.components.mlp.MLP")  # the runs compared within rounding (tests/rounding.py)
SCHEDULE = "lr_schedule={_target_: torch.optim.lr_scheduler.CosineAnnealingLR, T_max: 80}"


def stop_after(run_dir, step: int) -> None:
    """Leave the run folder as a run killed right after saving `step` would: nothing newer."""
    for folder in (run_dir / "checkpoints").iterdir():
        if folder.name.startswith("step_") and int(folder.name[5:]) > step:
            shutil.rmtree(folder)
    (run_dir / "model.pt").unlink()


@pytest.mark.parametrize("extra", [
    [],
    ["data.num_workers=2", SCHEDULE],
    ["trainer.grad_accum_steps=2", "trainer.clip_grad_norm=0.5", SCHEDULE],
], ids=["plain", "workers+schedule", "accumulation+clipping+schedule"])
def test_resume_mid_epoch_is_bitwise_exact(tmp_path, extra):
    whole = tmp_path / "whole"
    train(whole, *extra)  # uninterrupted, no checkpoint but the final one
    broken = tmp_path / "broken"
    train(broken, "checkpoint.every=15", "checkpoint.keep=10", *extra)
    stop_after(broken, 45)  # step 45 is in the middle of epoch 1 (32 or 16 steps per epoch)
    values = train(broken, *extra)
    assert values["train/loss"] > 0
    assert_same_weights(whole / "model.pt", broken / "model.pt")
    resumed_from = torch.load(broken / "checkpoints" / "step_80" / "state.pt", weights_only=True)
    assert resumed_from["position"]["step"] == 80


def test_loop_reads_nothing_on_the_host_between_log_steps(tmp_path, monkeypatch):
    """Host reads do not grow with the number of steps between two log steps: they happen on log steps only."""
    names = ["item", "tolist", "cpu", "numpy", "__bool__", "__format__", "__float__", "__int__", "__index__"]
    calls = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            calls.append(f"{name} from {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(self, *args, **kwargs)
        return wrapper

    def host_reads(steps: int) -> list:
        calls.clear()
        with monkeypatch.context() as m:
            for name in names:
                m.setattr(torch.Tensor, name, counting(name))
            # One log interval, within one epoch: every step but the last is "between log steps".
            # SGD: AdamW reads its step counters with .item(), but torch keeps those on the CPU on every
            # device, so they are no device reads on a GPU; here on the CPU they would be counted.
            train(tmp_path / str(steps), f"trainer.max_steps={steps}", f"trainer.log_every={steps}",
                  "optimizer={_target_: torch.optim.SGD, lr: 0.05, momentum: 0.9}",
                  "trainer.grad_accum_steps=2", "trainer.clip_grad_norm=1.0", "data.batch_size=16", SCHEDULE,
                  "checkpoint.every=null", "trainer.eval_every=null")
        return list(calls)

    short, long = host_reads(10), host_reads(30)
    assert any(c.startswith("tolist from") for c in short)  # the read per interval is seen: the patch works
    assert sorted(short) == sorted(long), f"reads grow with steps: {sorted(long)} vs {sorted(short)}"


def test_accumulation_equals_the_large_batch(tmp_path):
    train(tmp_path / "big", *EXACT, "data.batch_size=64", "trainer.max_steps=30")
    train(tmp_path / "accum", *EXACT, "data.batch_size=32", "trainer.grad_accum_steps=2", "trainer.max_steps=30")
    assert_within_rounding(tmp_path / "big" / "model.pt", tmp_path / "accum" / "model.pt", steps=30)


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    model = "model={_target_: tests.components.DivergesAt, at: 17}"
    with pytest.raises(TrainingDiverged, match="at step 17"):
        train(run, model, "checkpoint.every=10", "trainer.log_every=25")
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved == ["latest", "step_10"]
    assert not (run / "model.pt").exists()
    good = state_dict(run / "checkpoints" / "step_10" / "model.pt")
    assert all(torch.isfinite(t).all() for t in good.values())


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_nan_exit_code_and_message(tmp_path):
    done = launch("recipes/quickstart.yaml", "model={_target_: tests.components.DivergesAt, at: 3}",
                  f"run_dir={tmp_path}", "logging.tensorboard=false", "trainer.max_steps=20")
    assert done.returncode == 3  # EXIT_DIVERGED: neither a bug (1) nor a user mistake (2)
    assert "the training loss is nan at step 3" in done.stderr and "Traceback" not in done.stderr


def test_bf16_autocast_on_cpu(tmp_path):
    values = train(tmp_path, "precision=bf16", "trainer.max_steps=40")
    assert 0 < values["train/loss"] < 2.3  # learns: chance is ln(10) = 2.30


def test_fp16_needs_cuda(tmp_path):
    with pytest.raises(UserError, match="fp16 needs a CUDA device"):
        train(tmp_path, "precision=fp16", "devices=cpu")


def test_max_epochs_and_max_steps_whichever_first(tmp_path):
    train(tmp_path / "epochs", "trainer.max_steps=null", "trainer.max_epochs=2")  # 32 steps per epoch
    assert torch.load(tmp_path / "epochs/checkpoints/step_64/state.pt", weights_only=True)["position"]["epoch"] == 1
    train(tmp_path / "steps", "trainer.max_steps=40", "trainer.max_epochs=5")
    assert (tmp_path / "steps/checkpoints/step_40").is_dir()


def test_a_finished_run_is_not_trained_again(tmp_path):
    train(tmp_path)
    before = state_dict(tmp_path / "model.pt")
    assert train(tmp_path) == {}
    after = state_dict(tmp_path / "model.pt")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_batch_too_large_for_the_data(tmp_path):
    with pytest.raises(UserError, match=r"data.train: 1024 items are fewer than one optimizer step takes"):
        train(tmp_path, "data.batch_size=2048")


def test_resuming_with_a_changed_recipe_says_what_changed(tmp_path, capsys):
    train(tmp_path, "trainer.max_steps=20", "checkpoint.every=10")
    capsys.readouterr()
    train(tmp_path, "trainer.max_steps=40")
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_20" in out
    assert "the recipe differs from the checkpoint's in trainer.max_steps (20 -> 40)" in out


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_compile_trains_the_same_model_and_saves_plain_keys(tmp_path):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = train(tmp_path / "eager", *EXACT, "checkpoint.every=40")
    compiled = train(tmp_path / "compiled", *EXACT, "checkpoint.every=40", "trainer.compile=true")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    a, b = state_dict(tmp_path / "eager/model.pt"), state_dict(tmp_path / "compiled/model.pt")
    assert list(a) == list(b)  # no _orig_mod. prefix: loads into the plain model
    assert_within_rounding(a, b, steps=80)
    assert abs(eager["train/loss"] - compiled["train/loss"]) < 1e-4
    # and it resumes: a compiled run continues from its own checkpoint
    shutil.rmtree(tmp_path / "compiled/checkpoints/step_80")
    (tmp_path / "compiled/model.pt").unlink()
    train(tmp_path / "compiled", *EXACT, "checkpoint.every=40", "trainer.compile=true")
    assert_within_rounding(b, tmp_path / "compiled/model.pt", steps=80)
