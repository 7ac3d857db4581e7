"""A real HuggingFace model (GPT-2 built from a small config) trained from recipes/hf_causal_lm.yaml, with
no adapter code: variable-length token batches padded by the collate, the model's own loss, and
token-weighted accumulation: one process, accumulation, DDP and Accelerate give the same weights."""

import sys

import pytest

from tests.conftest import REPO, assert_same_weights, launch, state_dict
from tests.rounding import assert_within_rounding, float64
from tests.test_strategies import ACCELERATE, free_port, run

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

RECIPE = REPO / "recipes" / "hf_causal_lm.yaml"
# Six steps of 16 passages of 16 to 96 tokens, 8 of them an unscored prompt: micro-batches differ in
# how many tokens they score. AdamW's eps is 1e-5, not 1e-8: GPT-2's attention key bias has a gradient
# that is zero but for rounding, and eps 1e-8 divides that noise by its own size (1e-10 differences
# became 1e-6 ones in 34 of its 384 values; SGD, or eps 1e-5, leaves none).
SHORT = ["trainer.max_steps=6", "trainer.log_every=3", "trainer.eval_every=null", "checkpoint.every=null",
         "logging.tensorboard=false", "logging.progress_bar=false", "data.val=null", "optimizer.eps=1e-5",
         "logging.memory_plan=false"]
EXACT = [*SHORT, *float64("transformers.GPT2LMHeadModel")]  # the runs compared within rounding (tests/rounding.py)
STEPS = 6


def train_here(run_dir, *overrides, val=False):
    from launcher.recipe import load
    from launcher.run.train import train

    short = [o for o in EXACT if o != "data.val=null" or not val]
    return train(load(RECIPE, [*short, f"run_dir={run_dir}", *overrides]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_single")
    train_here(folder, "data.batch_size=16")
    return folder / "model.pt"


def test_accumulation_weighs_every_token_alike(reference, tmp_path):
    train_here(tmp_path / "accum", "data.batch_size=4", "trainer.grad_accum_steps=4")
    assert_within_rounding(reference, tmp_path / "accum" / "model.pt", STEPS)


def test_a_mean_of_micro_batch_means_would_differ(reference, tmp_path, monkeypatch):
    # What HF Trainer did until late 2024: each micro-batch's mean counts alike. So the test above can fail.
    from launcher.model.step import ModelLoss

    counted = ModelLoss.__call__

    def uncounted(self, model, batch):  # the model's own mean, and no count
        out = counted(self, model, batch)
        out.pop("num_items", None)
        return out

    monkeypatch.setattr(ModelLoss, "__call__", uncounted)
    train_here(tmp_path, "data.batch_size=4", "trainer.grad_accum_steps=4")
    with pytest.raises(AssertionError):
        assert_within_rounding(reference, tmp_path / "model.pt", STEPS)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """DDP x2 and FSDP x2, each with accumulation, one after another in one torchrun launch (tests/several_runs.py):
    (root, each rank's results); case NAME's run folder is root / NAME."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("hf_two")
    cases = {name: [str(RECIPE), *EXACT, f"run_dir={root / name}", f"strategy={name}", "nproc_per_node=2",
                    "data.batch_size=8", "trainer.grad_accum_steps=2"] for name in ("ddp", "fsdp")}
    return root, several(cases, root, timeout=600)


def ran(two, name):
    """Case NAME's run folder and what rank 0 printed; the case ended without an error on both ranks."""
    root, ranks = two
    assert [results[name]["error"] for results in ranks] == [None, None], [results[name] for results in ranks]
    return root / name, ranks[0][name]["said"]


@pytest.mark.slow
def test_ddp_two_processes_with_accumulation(reference, two):
    folder, _ = ran(two, "ddp")
    assert_within_rounding(reference, folder / "model.pt", STEPS)


@pytest.mark.slow
def test_fsdp_two_processes_with_accumulation(reference, two):
    """GPT2Block as the sharding units (the model's _no_split_modules); the counted micro-steps skip the
    reduce-scatter, and the reduced gradients are rescaled to the step's token count after it."""
    folder, said = ran(two, "fsdp")
    assert "units GPT2Block" in said
    assert_within_rounding(reference, folder / "model.pt", STEPS)


@pytest.mark.slow
def test_accelerate_two_processes(reference, tmp_path):
    run([*ACCELERATE, "--multi_gpu", "--num_processes=2", "--num_machines=1", "--mixed_precision=no",
         "--dynamo_backend=no", f"--main_process_port={free_port()}", "-m", "launcher", str(RECIPE), *EXACT,
         f"run_dir={tmp_path}", "data.batch_size=16"], timeout=300)
    assert_within_rounding(reference, tmp_path / "model.pt", STEPS)


def test_model_pt_loads_strictly_into_gpt2(reference):
    config = transformers.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    model.load_state_dict(state_dict(reference), strict=True)


def test_resume_is_exact(reference, tmp_path):
    train_here(tmp_path, "data.batch_size=16", "trainer.max_steps=3", "checkpoint.every=3")
    train_here(tmp_path, "data.batch_size=16")  # resume=auto continues from step 3
    assert_same_weights(reference, tmp_path / "model.pt")


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_the_loss_falls_and_metrics_read_the_model_output(tmp_path):
    results = train_here(tmp_path, "trainer.max_steps=30", "trainer.log_every=10", "data.val.n=64", val=True)
    assert results["val/loss"] < 4.0 < 5.5  # log(256) = 5.55 at the start: a uniform guess over bytes
    assert 0.05 < results["val/accuracy"] <= 1 and 0.05 < results["train/accuracy"] <= 1


def test_a_string_field_stays_out_of_the_model(tmp_path, capsys):
    from launcher.cli import main  # python -m launcher's own, in this process

    code = main([str(RECIPE), *SHORT, f"run_dir={tmp_path}", "trainer.max_steps=2", "data.train.with_id=true"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "step: model(**batch) leaves out id (not arguments of GPT2LMHeadModel.forward)" in out


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_a_metric_that_cannot_read_a_model_output_is_one_line(tmp_path):
    done = launch(str(RECIPE), *SHORT, f"run_dir={tmp_path}", "metrics.top1._target_=tests.components_step.top1",
                  "metrics.top1._partial_=true", timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    # transformers may log its own warnings (loss_type) before: ours is one line, and no traceback
    ours = [line for line in done.stderr.splitlines() if not line.startswith("[transformers]")]
    assert len(ours) == 1 and ours[0].startswith("launcher: metrics.top1: cannot read the step's output "
                                                 "(a CausalLMOutputWithCrossAttentions)"), done.stderr


def test_a_loss_on_dict_batches_says_what_to_change(tmp_path, capsys):
    from launcher.cli import main  # python -m launcher's own, in this process

    code = main([str(RECIPE), *SHORT, f"run_dir={tmp_path}", "loss._target_=torch.nn.CrossEntropyLoss"])
    assert code == 2
    assert "the recipe's loss takes (input, target) pairs, and a batch is a dict; without loss:" in capsys.readouterr().err


def test_the_readmes_own_step_trains_the_hf_recipe(tmp_path, capsys, monkeypatch):
    readme = (REPO / "docs" / "your-model.md").read_text()  # the page's own step and its recipe lines
    code = readme.split("```python\n# my/steps.py\n", 1)[1].split("```", 1)[0]
    recipe = readme.split("```yaml\nstep: {_target_: my.steps.masked_lm", 1)[1].split("```", 1)[0]
    (tmp_path / "my").mkdir()
    (tmp_path / "my" / "steps.py").write_text(code)
    assert "loss: {_target_: torch.nn.CrossEntropyLoss}" in recipe
    from launcher.cli import main  # python -m launcher's own, in this process, the page's module on its path

    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code = main([str(RECIPE), *SHORT, f"run_dir={tmp_path / 'run'}", "step._target_=my.steps.masked_lm",
                     "step._partial_=true", "loss._target_=torch.nn.CrossEntropyLoss", "metrics={}"])
    finally:
        for name in ("my.steps", "my"):
            sys.modules.pop(name, None)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "done: step 6" in out
