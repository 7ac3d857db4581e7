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


@pytest.mark.parametrize("raw, says", [
    ("name: t\n".encode("utf-16"), ": UTF-16 or UTF-32 text; save the recipe as UTF-8"),
    ("name: t\n".encode("utf-16-le"), ": UTF-16 or UTF-32 text"),  # no byte order mark
    ("name: t\n".encode("utf-32"), ": UTF-16 or UTF-32 text"),
    (b"# a recipe\nname: caf\xe9\n", ":2: byte 0xe9 is not UTF-8 (Latin-1 or another encoding?)"),
    (b"PK\x03\x04\x00\x00", ": a zip archive (a torch.save file?), not a YAML recipe"),
    (b"\x80\x02}q\x00.", ": a pickle (a torch.save file?), not a YAML recipe"),
    (bytes(range(256)), ": binary data, not a YAML recipe"),
    (b"#" * 9000 + b"\nname: \x00\n", ":2: not valid YAML: unacceptable character #x0000"),  # past the sniffed head
    (b"name: t\nseed: \x07\n", ":2: not valid YAML: unacceptable character #x0007"),
    (b"name: t\n" + b"#" * (2 << 20), ": more than 1 MiB; a recipe is a few KB of YAML"),
], ids=["utf16", "utf16-no-bom", "utf32", "latin1", "zip", "pickle", "binary", "nul-late", "control", "huge"])
def test_files_that_are_not_yaml_text(tmp_path, raw, says):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(raw)
    lines = problems(path)
    assert len(lines) == 1 and lines[0].startswith(f"{path}{says}"), lines


def test_utf8_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert load(path).recipe.name == "t"


def test_endless_input_is_not_read_whole():
    if not __import__("os").path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    assert problems("/dev/zero") == ["/dev/zero: more than 1 MiB; a recipe is a few KB of YAML (is this the recipe file?)"]


def test_a_key_given_twice_is_named_with_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys silently; OmegaConf names neither section nor first line."""
    path = write(tmp_path, """\
        name: t
        model: {_target_: recipes.components.mlp.MLP, hidden: 8, hidden: 16}
        data:
          train: {_target_: recipes.components.synthetic.Blobs}
          batch_size: 8
          batch_size: 16
        slurm:
          setup:
            - {a: 1, a: 2}
        name: u
        """)
    assert problems(path) == [
        f"{path}:2: model.hidden: duplicate key (first at line 2); give each key once",
        f"{path}:6: data.batch_size: duplicate key (first at line 5); give each key once",
        f"{path}:9: slurm.setup.0.a: duplicate key (first at line 9); give each key once",
        f"{path}:10: name: duplicate key (first at line 1); give each key once",
    ]


def test_an_anchor_used_twice_is_not_a_duplicate(tmp_path):
    path = write(tmp_path, GOOD.replace("  train: {", "  val: &blobs {").replace("trainer:", "  train: *blobs\ntrainer:"))
    assert load(path).recipe.data.val == load(path).recipe.data.train


@pytest.mark.parametrize("extra, line", [
    ("x: " + "[" * 100_000, 9),
    ("".join(f"{'  ' * i}k{i}:\n" for i in range(40)), 41),  # k0 at line 9; k32's mapping is the 33rd level
    ("a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [[[[[[[[*a{i - 1}]]]]]]]]\n" for i in range(1, 5)), 13),  # a4: 33 lists
    ("x: &x [*x]\n", 9),  # itself
], ids=["flow", "block", "alias-chain", "alias-cycle"])
def test_nesting_deeper_than_any_recipe_is_one_line(tmp_path, extra, line):
    """Deep nesting would exhaust Python's recursion (or crash libyaml's C composer) before a message."""
    path = tmp_path / "recipe.yaml"
    path.write_text(GOOD + extra)
    assert problems(path) == [f"{path}:{line}: nested more than 32 levels deep; a recipe's sections nest a few "
                              f"levels (is this the recipe file?)"]


def test_nesting_up_to_the_limit_loads(tmp_path):
    deep = "[" * 30 + "]" * 30  # in the model mapping in the recipe's: 32 levels
    path = write(tmp_path, GOOD.replace("{_target_: recipes.components.mlp.MLP}", f"{{_target_: builtins.dict, x: {deep}}}"))
    assert load(path).recipe.model["x"] == eval(deep)
    assert load(path, [f"model.y={deep}"]).recipe.model["y"] == eval(deep)


INT64 = 2**63


@pytest.mark.parametrize("override, says", [
    (f"seed={INT64}", f"seed: must fit in 64 bits ({-INT64} to {INT64 - 1}), got {INT64}"),
    (f"seed={-INT64 - 1}", "seed: must fit in 64 bits"),
    (f"trainer.max_steps={INT64}", "trainer.max_steps: must fit in 64 bits"),
    (f"trainer.log_every={-2**64}", "trainer.log_every: must fit in 64 bits"),  # once, not also "1 or more"
    (f"data.batch_size={10**30}", "data.batch_size: must fit in 64 bits"),
    (f"checkpoint.every={10**30}", "checkpoint.every: must fit in 64 bits"),
    (f"nproc_per_node={2**64}", "nproc_per_node: must fit in 64 bits"),
    (f"slurm.nodes={2**70}", "slurm.nodes: must fit in 64 bits"),
    (f"seed={10**100}", "seed: must fit in 64 bits"),  # and quoted in short (the line stays short)
    ("data.num_workers=257", "data.num_workers: at most 256 loader processes per rank, got 257"),
    ("trainer.clip_grad_norm=inf", "trainer.clip_grad_norm: must be a positive number or null, got inf"),
    ("trainer.clip_grad_norm=-.inf", "trainer.clip_grad_norm: must be a positive number or null, got -inf"),
    ("logging.peak_tflops=.inf", "logging.peak_tflops: must be a positive number of TFLOP/s or null, got inf"),
    ("ddp.bucket_cap_mb=0", "ddp.bucket_cap_mb: must be a positive number of MiB below 2^43 or null, got 0.0"),
    ("ddp.bucket_cap_mb=-.inf", "ddp.bucket_cap_mb: must be a positive number of MiB below 2^43 or null, got -inf"),
    ("ddp.bucket_cap_mb=.nan", "ddp.bucket_cap_mb: must be a positive number of MiB below 2^43 or null, got nan"),
    (f"ddp.bucket_cap_mb={2**43}", "ddp.bucket_cap_mb: must be a positive number of MiB below 2^43"),  # its bytes: 2^63
    ("name=" + "a" * 256, "name: got 'aaaaaaaaa"),
    ("name=.", "name: got '.'"),
    ("slurm.setup=5", "slurm.setup: expected a list such as [a, b], got 5"),
])
def test_values_out_of_the_range_of_what_consumes_them(tmp_path, override, says):
    lines = problems(write(tmp_path, GOOD), override)
    assert len(lines) == 1 and f": {says}" in lines[0] and len(lines[0]) < 300, lines


def test_the_edges_of_the_ranges_load(tmp_path):
    for override in (f"seed={INT64 - 1}", f"seed={-INT64}", f"trainer.max_steps={INT64 - 1}", "data.num_workers=256",
                     "trainer.clip_grad_norm=1e308", "name=" + "a" * 255, "ddp.bucket_cap_mb=1e-3",
                     f"ddp.bucket_cap_mb={2**43 - 1}"):
        load(write(tmp_path, GOOD), [override])


@pytest.mark.parametrize("override, says", [
    ("name=caf\udce9", "holds bytes that are not UTF-8 text; write the value in UTF-8"),  # a shell's surrogate escape
    ("model.hidden=\udcff\udcfe", "holds bytes that are not UTF-8 text"),
    ("model.x=" + "[" * 100_000, "cannot parse the value: nested more than 32 levels deep"),
    ("model.x=" + "{a: " * 5000, "cannot parse the value: nested more than 32 levels deep"),
    ("model.x=&a [*a]", "cannot parse the value: nested more than 32 levels deep"),
    ("trainer.max_steps=" + "9" * 100_000, "... (100018 characters)': cannot parse the value"),
    ("trainer.max_steps=" + "x" * 100_000, "trainer.max_steps: expected an integer or null, got 'xxxxxx"),
    ("x" * 100_000 + "=1", "... (100002 characters)': xxxx"),
    ("name=a\x00b", "cannot parse the value: unacceptable character #x0000"),
    ("model={_target_: a, _target_: b}", "cannot parse the value: found duplicate key _target_"),
], ids=["not-utf8", "not-utf8-value", "deep-list", "deep-mapping", "alias-cycle", "long-number", "long-value",
        "long-key", "nul", "duplicate"])
def test_odd_overrides_are_one_short_line(tmp_path, override, says):
    lines = problems(write(tmp_path, GOOD), override)
    assert len(lines) == 1 and says in lines[0] and len(lines[0]) < 500, lines
