"""Pipeline parallelism over real torchrun processes (gloo): charlm's GPT and an HF Llama cut into stages give the
weights of one process under every schedule, their checkpoints resume under other layouts and pp degrees, a
rank killed mid-step resumes exactly, and the mistakes are one line on every rank.

The runs that train share a torchrun launch per world size (tests/several_runs.py); one process's runs train in
this one."""

import re

import pytest

from launcher.errors import UserError
from tests.conftest import assert_same_weights, state_dict
from tests.rounding import assert_within_rounding, float64
from tests.test_fsdp import CHARLM, CHARLM64
from tests.test_parallel import alone, ran
from tests.test_strategies import TORCHRUN, run

pytestmark = pytest.mark.slow

GPT = [*CHARLM64, "model.tie_weights=false", "model.n_layer=4"]  # accumulation 2, clipping, checkpoints every 6
SGD = ["optimizer={_target_: torch.optim.SGD, lr: 0.5, momentum: 0.9}", "lr_schedule=null"]
LLAMA = ["recipes/hf_causal_lm.yaml", "devices=cpu", "trainer.max_steps=6", "trainer.log_every=3",
         "trainer.eval_every=6", "data.train.n=256", "data.val.n=20", "data.batch_size=8", "logging.tensorboard=false",
         "logging.memory_plan=false", "checkpoint.every=6", *SGD,
         "model={_target_: transformers.LlamaForCausalLM, config: {_target_: transformers.LlamaConfig, "
         "vocab_size: 256, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 4, num_attention_heads: 4, "
         "num_key_value_heads: 2, max_position_embeddings: 128, tie_word_embeddings: false}}",
         *float64("transformers.LlamaForCausalLM")]
PP2 = ["strategy=fsdp", "parallel.pp=2"]
STEPS, LLAMA_STEPS = 12, 6  # GPT's and LLAMA's trainer.max_steps


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One process's runs, the references: charlm with SGD and with AdamW, the Llama."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("one")
    for name, args in {"sgd": [*GPT, *SGD], "adamw": GPT, "llama": LLAMA}.items():
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            alone(root / name, *args)
        (root / f"{name}.said").write_text(said.getvalue())
    return root


def page_command():
    """The CPU command of docs/parallelism.md's pipeline section, after `python -m launcher`."""
    from tests.test_docs import blocks, commands

    block = next(b for b in blocks("docs/parallelism.md")
                 if b.marker and b.marker[1].endswith("::test_the_pages_pipeline_command_runs"))
    argv = commands(block.body)[0].argv
    assert argv[:3] == ["python", "-m", "launcher"]
    return argv[3:]


@pytest.fixture(scope="module")
def two(tmp_path_factory, one):
    """pp x 2 runs in one launch: each schedule kind, a full checkpoint of one process resumed, the mistakes."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("pp")
    cases = {"1f1b-sgd": [*GPT, *SGD, *PP2],
             "zbv": [*GPT, *PP2, "parallel.pp_schedule=zbv"],
             "llama": [*LLAMA, *PP2, "parallel.pp_schedule=interleaved_1f1b"],
             "from-one": [*GPT, *PP2, "parallel.pp_schedule=interleaved_zb",
                          f"checkpoint.resume={one / 'adamw' / 'checkpoints' / 'step_6'}"],
             "fsdp-from-zbv": [*GPT, "strategy=fsdp", "checkpoint.every=3",
                               f"checkpoint.resume={root / 'zbv' / 'checkpoints' / 'step_6'}"],
             "ddp-from-zbv": [*GPT, "strategy=ddp", f"checkpoint.resume={root / 'zbv' / 'checkpoints' / 'step_6'}"],
             "from-fsdp": [*GPT, *PP2, "parallel.pp_schedule=looped_bfs",
                           f"checkpoint.resume={root / 'fsdp-from-zbv' / 'checkpoints' / 'step_9'}"],
             "microbatches": [*GPT, *PP2, "parallel.microbatches=3"],
             "too-few-microbatches": [*GPT, *PP2, "parallel.microbatches=1"],
             "uneven": [*GPT, *PP2, "model.n_layer=3"],
             "tied": [*CHARLM, *PP2],
             "no-blocks": ["recipes/quickstart.yaml", "devices=cpu", "logging.memory_plan=false", *PP2],
             # the first stage alone can hold ViT's patch embeddings: a later stage's refusal once left the first
             # waiting for it in its first send, and the run ended with no line
             "vit": ["tests/hf_zoo.yaml", "devices=cpu", "model._target_=tests.hf_zoo.vit",
                     "data.train._target_=tests.hf_zoo.Images", "data.collate=null", *PP2],
             "page": [*page_command(), "trainer.max_steps=4", "trainer.eval_every=4", "logging.memory_plan=false",
                      "logging.tensorboard=false"]}
    return root, several({name: [*args, f"run_dir={root / name}"] for name, args in cases.items()}, root, timeout=900)


def test_pipeline_stages_give_the_weights_of_one_process(one, two):
    """1f1b with SGD and momentum (accumulation, clipping), tight; zbv (two stages a rank, in a V) with AdamW."""
    folder, said = ran(two, "1f1b-sgd")
    assert "parallel.pp: pp 2 x dp_shard 1 = 2 ranks; 2 stages (1f1b, 2 micro-batches), this rank holds stage 0 " \
           "(stage 0: 2 blocks)" in said
    assert_within_rounding(one / "sgd" / "model.pt", folder / "model.pt", STEPS)
    folder, said = ran(two, "zbv")
    assert "4 stages (zbv, 4 micro-batches), this rank holds stage 0, 3" in said
    assert_within_rounding(one / "adamw" / "model.pt", folder / "model.pt", STEPS)
    logged = lambda text: re.findall(r"^step \d+/12 .*? \| loss ([\d.]+)", text, re.M)  # noqa: E731
    assert logged(said) == logged((one / "adamw.said").read_text())  # the whole model's loss, as one process logs it
    assert len(logged(said)) == 3


def test_an_hf_llama_in_stages_trains_as_one_process_and_exports(one, two, tmp_path):
    """Interleaved 1F1B, batches padded to their longest (each length its own schedule), the loss over the labels
    that count (token-weighted): one process's weights; the checkpoint exported as an HF folder loads."""
    from launcher import export

    folder, said = ran(two, "llama")
    assert "4 stages (interleaved_1f1b, 4 micro-batches)" in said
    assert_within_rounding(one / "llama" / "model.pt", folder / "model.pt", LLAMA_STEPS)
    assert export.main([str(folder / "checkpoints" / "step_6"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    import transformers

    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    expected = state_dict(folder / "model.pt")
    assert loaded.keys() == expected.keys()
    assert all((loaded[k] == expected[k]).all() for k in expected)


def test_checkpoints_cross_between_one_process_and_pipeline_stages(one, two, tmp_path, capsys):
    """One process's full checkpoint resumed by pp x 2 (interleaved zero bubble); the zbv run's sharded one resumed
    under fsdp x 2, ddp x 2 and in one process, and that fsdp run's resumed by pp x 2 (looped BFS): each ends as one
    process does."""
    folder, said = ran(two, "from-one")
    assert "written by 1 process" in said
    assert_within_rounding(one / "adamw" / "model.pt", folder / "model.pt", STEPS)
    folder, said = ran(two, "fsdp-from-zbv")
    assert "fsdp: sharded over 2 ranks" in said and f"resumed from {two[0] / 'zbv' / 'checkpoints' / 'step_6'}" in said
    assert_within_rounding(one / "adamw" / "model.pt", folder / "model.pt", STEPS)
    folder, said = ran(two, "ddp-from-zbv")
    assert "(ddp)" in said and f"resumed from {two[0] / 'zbv' / 'checkpoints' / 'step_6'}" in said
    assert_within_rounding(one / "adamw" / "model.pt", folder / "model.pt", STEPS)
    folder, said = ran(two, "from-fsdp")
    assert f"resumed from {two[0] / 'fsdp-from-zbv' / 'checkpoints' / 'step_9'}" in said and "looped_bfs" in said
    assert_within_rounding(one / "adamw" / "model.pt", folder / "model.pt", STEPS)
    capsys.readouterr()
    alone(tmp_path, *GPT, f"checkpoint.resume={two[0] / 'zbv' / 'checkpoints' / 'step_6'}")
    assert "written by 2 processes, resharded to 1" in capsys.readouterr().out
    assert_within_rounding(one / "adamw" / "model.pt", tmp_path / "model.pt", STEPS)


def test_the_pages_pipeline_command_runs(two):
    """docs/parallelism.md's command as a user types it (4 steps of it, one evaluation)."""
    folder, said = ran(two, "page")
    assert "4 stages (zbv, 4 micro-batches), this rank holds stage 0, 3" in said
    assert re.search(r"^eval at step 4 \| val/loss [\d.]+", said, re.M) and (folder / "model.pt").is_file()


def test_pipeline_mistakes_are_one_line_on_every_rank(two):
    root, ranks = two
    expected = {"microbatches": "parallel.microbatches: 3 does not divide this rank's batch of 8 rows",
                "too-few-microbatches": "parallel.microbatches: 1 with pp_schedule 1f1b: Number of microbatches (1) "
                                        "must be greater than or equal to the number of stages (2)",
                "uneven": "parallel.pp: the model's 3 blocks do not split evenly into 2 stages",
                "tied": "parallel.pp: transformer.wte.weight and lm_head.weight are one tied weight",
                "no-blocks": "parallel.pp: the model (MLP) has no repeated blocks",
                "vit": "parallel.pp: vit.embeddings (ViTEmbeddings) comes before the model's blocks and is not an "
                       "embedding, a Linear or a norm"}
    for name, line in expected.items():
        for rank, results in enumerate(ranks):
            assert results[name]["error"].startswith("UserError: " + line), (rank, name, results[name])


@pytest.mark.parametrize("override, line", [
    ("parallel.pp_schedule=zero", "parallel.pp_schedule: got 'zero'; valid: gpipe, 1f1b, interleaved_1f1b"),
    ("strategy=ddp", "parallel.pp: lays ranks out on a device mesh under strategy fsdp, and the strategy is 'ddp'"),
    ("parallel.stages_per_rank=2", "parallel.stages_per_rank: 1f1b runs one stage on each rank; use interleaved_1f1b"),
    ("trainer.compile=true", "trainer.compile: compiles the model that one call runs"),
])
def test_pipeline_keys_that_cannot_run_are_one_line(override, line):
    from launcher.recipe import load
    from tests.conftest import REPO

    with pytest.raises(UserError) as e:
        load(REPO / GPT[0], [*GPT[1:], *PP2, override])
    assert any(line in p for p in e.value.problems), e.value.problems


@pytest.fixture(scope="module")
def four(tmp_path_factory, two):
    """Four processes on two cores (torchrun itself): the zbv run's checkpoint resumed by pp 2 x dp_shard 2 (gpipe)
    and by pp 4 (another pp degree)."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("four")
    resume = f"checkpoint.resume={two[0] / 'zbv' / 'checkpoints' / 'step_6'}"
    cases = {"pp2-dp2": [*GPT, *PP2, "parallel.pp_schedule=gpipe", resume],
             "pp4": [*GPT, "strategy=fsdp", "parallel.pp=4", resume]}
    return root, several({name: [*args, f"run_dir={root / name}"] for name, args in cases.items()}, root, nproc=4,
                         timeout=900)


def test_pipeline_checkpoints_resume_at_other_pp_degrees_and_data_parallel(one, four):
    folder, said = ran(four, "pp2-dp2")
    assert "pp 2 x dp_shard 2 = 4 ranks" in said and "written by 2 processes, resharded to 4" in said
    assert_within_rounding(one / "adamw" / "model.pt", folder / "model.pt", STEPS)
    folder, said = ran(four, "pp4")
    assert "pp 4 x dp_shard 1 = 4 ranks; 4 stages" in said
    assert_within_rounding(one / "adamw" / "model.pt", folder / "model.pt", STEPS)


def test_a_stage_killed_mid_step_resumes_exactly(tmp_path, two):
    """SIGKILL the last stage's rank at a seeded micro-batch past the first checkpoint: torchrun restarts both,
    they resume from step 6, and the run ends bitwise as the one no kill stopped."""
    import random

    # a step is 4 forwards (2 micro-batches x 2 accumulated), after one on empty tensors that probes the shapes:
    # step k ends at forward 4k + 1, and forwards 27 to 45 are steps 7 to 11
    at = random.Random(39).randrange(27, 46)
    dies = *float64("tests.components.GPTDiesOnce"), f"model.at={at}"
    done = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "-m", "launcher", *GPT, *SGD,
                *PP2, *dies, f"run_dir={tmp_path}"], timeout=300)
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_6'}" in done.stdout
    assert_same_weights(two[0] / "1f1b-sgd" / "model.pt", tmp_path / "model.pt")
