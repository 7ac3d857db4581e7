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
    lines = problems(write(tmp_path, GOOD), "precision=fp4", "strategy=magic", "devices=gpu7", "trainer.max_steps=0")
    text = "\n".join(lines)
    assert len(lines) == 4, text
    assert "precision: got 'fp4'; valid: fp32, bf16, fp16, fp8" in text
    assert "strategy: got 'magic'; valid: auto, single, dp, ddp, fsdp, accelerate" in text
    assert "devices: got 'gpu7'" in text
    assert "trainer.max_steps: must be 1 or more, got 0" in text
    assert all(l.startswith("override '") for l in lines), text


def test_the_parallel_section_is_checked_at_load(tmp_path):
    lines = problems(write(tmp_path, GOOD), "strategy=ddp", "parallel.tp=2", "parallel.dp_replicate=0",
                     "parallel.tp_plan={fc1: colwise, fc2: diagonal}")
    text = "\n".join(lines)
    assert len(lines) == 3, text
    assert ("parallel.tp: lays ranks out on a device mesh under strategy fsdp, and the strategy is 'ddp'; set "
            "strategy=fsdp, or parallel.tp=1") in text
    assert "parallel.dp_replicate: must be 1 or more, got 0" in text
    assert "parallel.tp_plan.fc2: got 'diagonal'; valid: colwise, rowwise, colwise_rep, rowwise_rep, embedding_rowwise" in text


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


def test_a_target_by_the_path_its_module_had_before_the_move_into_folders_is_found_there():
    """CHANGELOG.md, 0.2: launcher.collate became launcher.data.collate, and so on; old recipes still build."""
    from launcher.recipe.instantiate import TargetError, locate

    from launcher.data import collate, sampling
    from launcher.model import step
    from launcher.run import metrics

    assert locate("launcher.collate.Pad") is collate.Pad and locate("launcher.metrics.Accuracy") is metrics.Accuracy
    assert locate("launcher.step.Supervised") is step.Supervised and locate("launcher.step.ModelLoss") is step.ModelLoss
    assert locate("launcher.data.TensorBatches") is sampling.TensorBatches  # data.py is data/sampling.py
    with pytest.raises(TargetError, match="'launcher.data.collate' has no attribute 'Nope'"):
        locate("launcher.collate.Nope")


def test_target_arguments_are_checked(tmp_path):
    lines = problems(write(tmp_path, GOOD), "model.widht=3", "optimizer.lrr=1")
    text = "\n".join(lines)
    assert len(lines) == 2, text
    # named as the override that set it, with the arguments the target takes
    assert ("override 'model.widht=3': model.widht: 'recipes.components.mlp.MLP' takes no argument 'widht'; its "
            "arguments: in_dim, hidden, classes, layers") in lines
    assert ("override 'optimizer.lrr=1': optimizer.lrr: 'torch.optim.SGD' takes no argument 'lrr'; did you mean 'lr'? "
            "its arguments: params, lr, momentum, dampening, weight_decay, nesterov, maximize, foreach, "
            "differentiable, fused") in lines


def test_a_word_where_a_number_belongs_is_named_where_it_was_set(tmp_path):
    lines = problems(write(tmp_path, GOOD), "optimizer.momentum=fast", "model.hidden=wide")
    assert lines == ["override 'model.hidden=wide': model.hidden: 'recipes.components.mlp.MLP' takes a number for "
                     "'hidden' (its default: 128), got the string 'wide'",
                     "override 'optimizer.momentum=fast': optimizer.momentum: 'torch.optim.SGD' takes a number for "
                     "'momentum' (its default: 0), got the string 'fast'"], lines
    load(write(tmp_path, GOOD), ["loss.reduction=sum"])  # a word where the default is one: loads


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

    bad = launch(str(QUICKSTART), "trainer.max_step=5", "precision=fp4")
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        "launcher: override 'trainer.max_step=5': trainer.max_step: unknown key; did you mean 'trainer.max_steps'?",
        "launcher: override 'precision=fp4': precision: got 'fp4'; valid: fp32, bf16, fp16, fp8",
    ], bad.stderr  # every problem at once: a value check beside a name check
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
    ("trainer.loss_chunk=-1", "trainer.loss_chunk: must be 0 or more, got -1"),
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
    ("data.multiprocessing_context=fro", "data.multiprocessing_context: is how loader workers start: one of fork, "
                                         "forkserver, spawn or null, got 'fro'"),
    ("data.multiprocessing_context=spawn", "data.multiprocessing_context: is how loader workers start, and "
                                           "data.num_workers is 0"),
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


def test_partial_builds_a_functools_partial():
    import functools

    from tests.components import mean_error

    built = instantiate({"_target_": "tests.components.mean_error", "_partial_": True, "scale": 2.0})
    assert isinstance(built, functools.partial) and built.func is mean_error
    assert built.args == () and built.keywords == {"scale": 2.0}  # _partial_ is not an argument
    assert instantiate({"_target_": "builtins.dict", "_partial_": True, "a": 1})(b=2) == {"a": 1, "b": 2}
    with_args = instantiate({"_target_": "builtins.dict", "_partial_": True}, [("x", 0)])  # the launcher's positionals
    assert with_args.args == ([("x", 0)],) and with_args() == {"x": 0}
    nested = instantiate({"_target_": "builtins.dict", "_partial_": True,
                          "inner": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}})
    assert nested.keywords["inner"].weight.shape == (3, 2)  # nested specs are built first
    assert instantiate({"_target_": "builtins.dict", "_partial_": False, "a": 1}) == {"a": 1}


PARTIALS = """\
loss: {_target_: torch.nn.functional.cross_entropy, _partial_: true, label_smoothing: 0.1}
step: {_target_: tests.components.mean_error, _partial_: true}
metrics:
  error: {_target_: tests.components.mean_error, _partial_: true, scale: 2.0}
data:
  train: {_target_: recipes.components.synthetic.Blobs, n: 256}
  collate: {_target_: torch.utils.data.default_collate, _partial_: true}
"""


def test_partial_functions_with_required_parameters_load(tmp_path):
    """A function's required parameters (output, target, batch...) are the launcher's to pass at call time."""
    text = GOOD.replace("loss: {_target_: torch.nn.CrossEntropyLoss}\n", "").replace(
        "data:\n  train: {_target_: recipes.components.synthetic.Blobs, n: 256}\n", PARTIALS)
    recipe = load(write(tmp_path, text)).recipe
    assert recipe.loss["_partial_"] is True and recipe.step["_target_"] == "tests.components.mean_error"
    assert recipe.data.collate == {"_target_": "torch.utils.data.default_collate", "_partial_": True}
    assert instantiate(recipe.metrics["error"]).keywords == {"scale": 2.0}


def test_partial_arguments_are_still_checked(tmp_path):
    path = write(tmp_path, GOOD.replace("data:\n", "metrics:\n  error: {_target_: tests.components.mean_error, "
                                                  "_partial_: true, scael: 2}\ndata:\n"))
    lines = problems(path, "loss={_target_: torch.nn.functional.cross_entropy, _partial_: true, weigth: 1}")
    assert len(lines) == 2, lines
    assert lines[0].startswith("override 'loss={_target_: torch.nn.functional.cross_entropy, _partial_: true, "
                               "weigth: 1}': loss.weigth: 'torch.nn.functional.cross_entropy' takes no argument "
                               "'weigth'; did you mean 'weight'? its arguments: input, target, weight,"), lines
    assert lines[1] == (f"{path}:5: metrics.error.scael: 'tests.components.mean_error' takes no argument 'scael'; "
                        f"did you mean 'scale'? its arguments: output, target, scale")


@pytest.mark.parametrize("override, says", [
    ("loss._partial_=maybe", "loss._partial_: must be true or false, got 'maybe'"),
    ("loss._partial_=1", "loss._partial_: must be true or false, got 1"),
    ("model.act={_partial_: true}", "model.act._partial_: only means something beside a _target_"),
    ("model.act={_target_: torch.nn.GELU, _partial_: 'no'}", "model.act._partial_: must be true or false, got 'no'"),
], ids=["word", "number", "no-target", "nested"])
def test_partial_is_true_or_false(tmp_path, override, says):
    lines = problems(write(tmp_path, GOOD), override)
    assert len(lines) == 1 and lines[0].startswith(f"override '{override}': {says}"), lines


def test_a_function_without_partial_is_told_to_add_it(tmp_path):
    lines = problems(write(tmp_path, GOOD), "loss._target_=torch.nn.functional.cross_entropy",
                     "data.collate._target_=torch.utils.data.default_collate", "model._target_=torch.nn.Linear")
    assert len(lines) == 3, lines
    assert "missing a required argument: 'in_features'" in lines[0] and "_partial_" not in lines[0]  # it is built
    lines = lines[1:]
    assert lines[0].startswith("override 'loss._target_=torch.nn.functional.cross_entropy': loss._target_: "
                               "'torch.nn.functional.cross_entropy' missing a required argument: 'input'")
    assert lines[0].endswith("; add _partial_: true to have the launcher call it with them")
    assert lines[1].startswith("override 'data.collate._target_=torch.utils.data.default_collate': data.collate.")
    assert lines[1].endswith("; add _partial_: true to have the launcher call it with them")


NULLS = {"loss": "loss: null", "lr_schedule": "lr_schedule: null", "data.val": "  val: null", "step": "step: null"}


@pytest.mark.parametrize("key, override, built", [
    ("loss", "loss._target_=torch.nn.CrossEntropyLoss", {"_target_": "torch.nn.CrossEntropyLoss"}),
    ("lr_schedule", "lr_schedule={_target_: torch.optim.lr_scheduler.StepLR, step_size: 10}",
     {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 10}),
    ("data.val", "data.val._target_=recipes.components.synthetic.Blobs",
     {"_target_": "recipes.components.synthetic.Blobs", "n": 64}),
    ("step", "step._target_=tests.components.mean_error", {"_target_": "tests.components.mean_error",
                                                           "_partial_": True}),
], ids=list(NULLS))
def test_an_override_onto_a_null_section_creates_it(tmp_path, key, override, built):
    """As Hydra's `+loss._target_=...` would: the mapping is created, key by key."""
    text = GOOD.replace("loss: {_target_: torch.nn.CrossEntropyLoss}", "loss: null").replace(
        "trainer:", "  val: null\ntrainer:") + "lr_schedule: null\nstep: null\n"
    rest = {"data.val": ["data.val.n=64"], "step": ["step._partial_=true"]}.get(key, [])
    recipe = load(write(tmp_path, text), [override, *rest]).recipe
    assert eval(f"recipe.{key}") == built
    assert load(write(tmp_path, text)).recipe.loss is None  # null stays null without an override


def test_an_override_onto_a_null_or_missing_section_says_what_it_lacks(tmp_path):
    path = write(tmp_path, GOOD.replace("model: {_target_: recipes.components.mlp.MLP}\n", "")
                 + "lr_schedule: null\n")
    assert load(path, ["model._target_=torch.nn.Linear", "model.in_features=2", "model.out_features=3"]
                ).recipe.model == {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}
    assert problems(path, "model.hidden=3", "lr_schedule.step_size=10") == [
        "override 'model.hidden=3': model: needs a _target_ naming an importable callable, "
        "e.g. {_target_: torch.nn.CrossEntropyLoss}",
        "override 'lr_schedule.step_size=10': lr_schedule: needs a _target_ naming an importable callable, "
        "e.g. {_target_: torch.nn.CrossEntropyLoss}",
    ]
    path = write(tmp_path, GOOD)
    assert problems(path, "seed.x=1", "nproc_per_node.x=2") == [  # not mappings: nothing is created
        "override 'seed.x=1': seed.x: seed is an integer, not a mapping; set it whole, as seed=...",
        "override 'nproc_per_node.x=2': nproc_per_node.x: nproc_per_node is an integer or null, not a mapping; "
        "set it whole, as nproc_per_node=...",
    ]


def test_an_override_onto_a_null_loss_from_the_command_line(tmp_path):
    path = tmp_path / "quickstart.yaml"
    path.write_text(QUICKSTART.read_text().replace("loss: {_target_: torch.nn.CrossEntropyLoss}", "loss: null"))
    done = launch(str(path), "loss._target_=torch.nn.CrossEntropyLoss", "loss.label_smoothing=0.1", "--print-config")
    assert done.returncode == 0, done.stderr
    assert "loss:\n  _target_: torch.nn.CrossEntropyLoss\n  label_smoothing: 0.1\n" in done.stdout


def test_partial_loss_and_metric_train(tmp_path):
    from tests.conftest import train

    results = train(tmp_path, "loss={_target_: torch.nn.functional.cross_entropy, _partial_: true}",
                    "metrics.error={_target_: tests.components.mean_error, _partial_: true, scale: 100.0}")
    assert results["val/error"] < 50 and results["val/accuracy"] > 0.5, results


def test_every_kind_of_problem_at_once(tmp_path):
    """A misspelt key, a wrong type, a value out of range, a target that does not import and an argument its
    target lacks: five lines, whichever check finds each."""
    lines = problems(write(tmp_path, GOOD), "trainer.max_step=5", "seed=abc", "data.batch_size=0",
                     "loss._target_=torch.nn.Nope", "optimizer.lrr=1")
    keys = [line.split(": ")[1] for line in lines]
    assert keys == ["trainer.max_step", "seed", "data.batch_size", "loss._target_", "optimizer.lrr"], lines


@pytest.mark.parametrize("first", ["data=${nope}", "data=${name}", "logging=${seed}"])
def test_a_key_inside_a_section_set_to_an_interpolation_is_one_line(first):
    """`data=${x}` then `data.batch_size=3` (found by tests/test_fuzz.py): OmegaConf resolved the section to fill it
    in, and its InterpolationKeyError or type error was a traceback."""
    section = first.split("=")[0]
    inner = {"data": "data.batch_size=3", "logging": "logging.mlflow.tracking_uri=x"}[section]
    with pytest.raises(UserError) as e:
        load(QUICKSTART, [first, inner])
    held = first.split("=", 1)[1]
    assert f"override '{inner}': {inner.split('=')[0]}: {section} is '{held}', an interpolation, not a section whose " \
           f"keys can be set one by one; set {section} as a mapping, or leave the interpolation out" in e.value.problems
    assert all("\n" not in p for p in e.value.problems)


def test_the_loss_in_chunks_with_tp_is_one_line(tmp_path):
    lines = problems(write(tmp_path, GOOD), "strategy=fsdp", "parallel.tp=2", "trainer.loss_chunk=64")
    assert len(lines) == 1 and "trainer.loss_chunk: is not built with parallel.tp or parallel.pp yet" in lines[0], lines
