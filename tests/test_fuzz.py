"""Generated recipes and overrides never end in a traceback: a valid recipe, or UserError (exit 2)."""

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.errors import UserError
from launcher.recipe import load
from tests.conftest import QUICKSTART

KEYS = ["name", "run_dir", "seed", "strategy", "devices", "precision", "nproc_per_node", "model", "model._target_",
        "model.hidden", "loss", "optimizer.lr", "lr_schedule", "metrics.accuracy", "data.train.n", "data.batch_size",
        "data.num_workers", "trainer.max_steps", "trainer.max_epochs", "trainer.clip_grad_norm", "trainer.log_every",
        "checkpoint.every", "checkpoint.keep", "checkpoint.resume", "logging.tensorboard", "slurm.nodes",
        "slurm.time", "slurm.setup", "nope", "trainer.nope", "data"]
VALUES = st.one_of(
    st.integers(-5, 10**6).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["null", "true", "[]", "{}", "[0, 3]", "auto:2", "cuda", "${name}", "${nope}", "${", "'",
                     "{_target_: torch.nn.Linear}", "{_target_: os.system}", "[1,", "a: b", "!!python/object:os.system"]),
    st.text(alphabet=string.printable, max_size=20),
)
OVERRIDES = st.lists(st.one_of(st.tuples(st.sampled_from(KEYS), VALUES).map("=".join),
                               st.text(alphabet=string.printable, max_size=25)), max_size=4)


@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=OVERRIDES)
def test_overrides_load_or_say_why(overrides):
    try:
        load(QUICKSTART, overrides)
    except UserError as e:
        assert e.problems and all("\n" not in p and p.strip() for p in e.problems)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=200),
                      st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=6).map(
                          lambda pairs: "\n".join(f"{k.split('.')[0]}: {v}" for k, v in pairs))))
@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_recipe_files_load_or_say_why(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    path.write_text(text)
    try:
        load(path)
    except UserError as e:
        assert e.problems and all("\n" not in p for p in e.problems)


TRAINING_VALUES = {
    "model.hidden": st.integers(-3, 64), "model.layers": st.integers(-1, 3), "optimizer.lr": st.floats(-1, 1),
    "data.batch_size": st.integers(-1, 300), "trainer.grad_accum_steps": st.integers(-1, 3),
    "trainer.clip_grad_norm": st.one_of(st.none(), st.floats(-1, 5)), "data.train.n": st.integers(-2, 300),
    # Up to the model's 10 outputs: more classes than outputs is a mismatch of data and model that the
    # first-batch check finds only when that batch holds such a label (test_bad_input has a case).
    "data.train.classes": st.integers(-1, 10), "precision": st.sampled_from(["fp32", "bf16", "fp16", "int8"]),
    "trainer.log_every": st.integers(-1, 3), "checkpoint.keep": st.integers(-1, 2),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(choice=st.dictionaries(st.sampled_from(sorted(TRAINING_VALUES)), st.none(), min_size=1, max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: TRAINING_VALUES[k] for k in keys})))
@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_training_with_generated_values_exits_0_or_2(tmp_path_factory, choice):
    """Through the command line and two training steps: a run or one line, never a traceback."""
    import contextlib
    import io

    from launcher.cli import main

    overrides = [f"{k}={'null' if v is None else v}" for k, v in choice.items()]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(QUICKSTART), "trainer.max_steps=2", "data.val=null", "logging.tensorboard=false",
                     "logging.memory_plan=false", f"run_dir={tmp_path_factory.mktemp('run')}", *overrides])
    assert code in (0, 1, 2), (overrides, err.getvalue())  # 1: a generated learning rate made the loss NaN
    assert "Traceback" not in err.getvalue()
    if code == 2:  # (torch may add its own warnings, say for a zero-size layer: those are not ours)
        assert [l for l in err.getvalue().splitlines() if l.startswith("launcher: ")], err.getvalue()


def test_recipe_strings_are_never_code(tmp_path):
    """Only OmegaConf's own resolvers exist: interpolation and environment variables, nothing that evaluates."""
    import os

    loaded = load(QUICKSTART, ["name=${oc.env:USER,someone}"])
    assert loaded.recipe.name == os.environ.get("USER", "someone")
    with pytest.raises(UserError, match="cannot parse the value"):
        load(QUICKSTART, ["name=${eval:__import__('os').system('touch " + str(tmp_path / "ran") + "')}"])
    with pytest.raises(UserError, match=r"name: cannot resolve '\$\{eval:1\}': Unsupported interpolation type eval"):
        load(QUICKSTART, ["name=${eval:1}"])
    assert not (tmp_path / "ran").exists()
