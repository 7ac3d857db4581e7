"""Recipes load strictly: every problem at once, one line each, naming the file (and line) and key."""

import textwrap

import pytest

from launcher.errors import UserError
from launcher.recipe import instantiate, load
from tests.conftest import QUICKSTART, launch


def write(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(text))
    return path


GOOD = """\
name: t
model: {_target_: recipes.components.mlp.MLP}
loss: {_target_: torch.nn.CrossEntropyLoss}
optimizer: {_target_: torch.optim.SGD, lr: 0.1}
data:
  train: {_target_: recipes.components.synthetic.Blobs, n: 256}
trainer:
  max_steps: 10
"""


def problems(path, *overrides) -> list[str]:
    with pytest.raises(UserError) as info:
        load(path, list(overrides))
    return info.value.problems


def test_defaults_and_interpolation(tmp_path):
    loaded = load(write(tmp_path, GOOD), ["name=other"])
    assert loaded.recipe.run_dir == "runs/other"  # ${name} resolved after the override
    assert loaded.recipe.trainer.max_steps == 10
    assert loaded.recipe.data.batch_size == 64
    assert loaded.config.run_dir == "runs/other"


def test_every_problem_is_reported_at_once(tmp_path):
    path = write(tmp_path, GOOD.replace("name: t\n", "").replace("max_steps: 10", "max_step: 10\n  log_every: often")
                 + "optimizer_x: 1\n")
    lines = problems(path, "data.batch_size=many")
    text = "\n".join(lines)
    assert len(lines) == 5, text
    assert f"{path}:7: trainer.max_step: unknown key; did you mean 'trainer.max_steps'?" in lines
    assert any(l.startswith(f"{path}:8: trainer.log_every: expected an integer") for l in lines), text
    assert any(l.startswith(f"{path}:9: optimizer_x: unknown key") for l in lines), text
    assert any("override 'data.batch_size=many': data.batch_size: expected an integer" in l for l in lines), text
    assert any(l == f"{path}: name: required value is missing" for l in lines), text


def test_value_checks_name_the_key_and_the_valid_values(tmp_path):
    lines = problems(write(tmp_path, GOOD), "precision=fp8", "strategy=magic", "devices=gpu7", "trainer.max_steps=0")
    text = "\n".join(lines)
    assert len(lines) == 4, text
    assert "precision: got 'fp8'; valid: fp32, bf16, fp16" in text
    assert "strategy: got 'magic'; valid: auto, single, dp, ddp, accelerate" in text
    assert "devices: got 'gpu7'" in text
    assert "trainer.max_steps: must be 1 or more, got 0" in text
    assert all(l.startswith("override '") for l in lines), text


def test_missing_steps_and_epochs(tmp_path):
    lines = problems(write(tmp_path, GOOD), "trainer.max_steps=null")
    assert lines == ["override 'trainer.max_steps=null': trainer.max_steps: set trainer.max_steps or trainer.max_epochs (or both)"]


@pytest.mark.parametrize("override, expected", [
    ("trainer.max_steps", "expected key=value"),
    ("=3", "expected key=value"),
    ("trainer..max_steps=3", "expected key=value"),
    ("trainer.max_steps=[1,", "cannot parse the value"),
])
def test_malformed_overrides(tmp_path, override, expected):
    lines = problems(write(tmp_path, GOOD), override)
    assert len(lines) == 1 and lines[0].startswith(f"override '{override}': {expected}"), lines


def test_broken_interpolation(tmp_path):
    lines = problems(write(tmp_path, GOOD), "run_dir=runs/${nope}")
    assert len(lines) == 1 and "run_dir: cannot resolve 'runs/${nope}'" in lines[0], lines


@pytest.mark.parametrize("target, expected", [
    ("recipes.components.mlp.NoSuch", "'recipes.components.mlp' has no attribute 'NoSuch'"),
    ("nosuchpackage.Model", "no module named 'nosuchpackage'"),
    ("recipes.components.mlp", "is not callable"),
    ("not a path", "is not a dotted Python path"),
])
def test_targets_must_import(tmp_path, target, expected):
    lines = problems(write(tmp_path, GOOD.replace("recipes.components.mlp.MLP", repr(target))))
    assert len(lines) == 1 and lines[0].startswith(f"{tmp_path / 'recipe.yaml'}:2: model._target_: "), lines
    assert expected in lines[0]


def test_target_arguments_are_checked(tmp_path):
    lines = problems(write(tmp_path, GOOD), "model.widht=3", "optimizer.lrr=1")
    text = "\n".join(lines)
    assert len(lines) == 2, text
    assert "model._target_: 'recipes.components.mlp.MLP' got an unexpected keyword argument 'widht'" in text
    assert "optimizer._target_: 'torch.optim.SGD' got an unexpected keyword argument 'lrr'" in text


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "name: t\nmodel: {_target_: x\n")
    lines = problems(path)
    assert len(lines) == 1 and lines[0].startswith(f"{path}:3: not valid YAML"), lines


def test_missing_file_and_non_mapping(tmp_path):
    assert problems(tmp_path / "nope.yaml") == [f"{tmp_path / 'nope.yaml'}: recipe file not found"]
    assert "is a mapping of keys" in problems(write(tmp_path, "- 1\n- 2\n"))[0]


def test_nested_targets_are_built():
    built = instantiate({"_target_": "torch.nn.Sequential"})
    assert len(built) == 0
    spec = {"_target_": "builtins.dict", "inner": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}}
    assert instantiate(spec)["inner"].weight.shape == (3, 2)


def test_command_line_print_config_and_errors(tmp_path):
    done = launch(str(QUICKSTART), "name=printed", "--print-config")
    assert done.returncode == 0, done.stderr
    assert "run_dir: runs/printed" in done.stdout and "${" not in done.stdout

    bad = launch(str(QUICKSTART), "trainer.max_step=5", "precision=fp8")
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        "launcher: override 'trainer.max_step=5': trainer.max_step: unknown key; did you mean 'trainer.max_steps'?",
    ], bad.stderr  # value checks come after name and type checks pass
    assert "Traceback" not in bad.stderr

    flag = launch(str(QUICKSTART), "--no-such-flag")
    assert flag.returncode == 2 and len(flag.stderr.splitlines()) == 1 and "--no-such-flag" in flag.stderr


def test_a_whole_mapping_replaces_a_dotted_key_changes_one_value(tmp_path):
    loaded = load(write(tmp_path, GOOD), ["model={_target_: torch.nn.Linear, in_features: 2, out_features: 3}",
                                          "optimizer.momentum=0.9"])
    assert loaded.recipe.model == {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}
    assert loaded.recipe.optimizer == {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}
