"""Generated recipes and overrides never end in a traceback: a valid recipe, or UserError (exit 2)."""

import string

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
def test_recipe_files_load_or_say_why(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    path.write_text(text)
    try:
        load(path)
    except UserError as e:
        assert e.problems and all("\n" not in p for p in e.problems)
