"""Strategy fsdp over real torchrun processes (gloo on the CPU): the weights of one process, and sharded
checkpoints that resume exactly at the same world size and closely at any other, under any strategy.

The two-process runs that train share one torchrun launch (tests/several_runs.py), one after another: the
ones that resume come after the runs whose checkpoints they read. One process's runs train in this one. The
runs that must fail with one line are launched as a user types them, each on its own."""

import json
import sys

import pytest

from tests.conftest import REPO, assert_same_weights
from tests.pace import paced
from tests.rounding import assert_within_rounding, float64
from tests.test_strategies import RECIPE, run

pytestmark = pytest.mark.slow  # real torchrun / multi-process runs: python -m pytest -m 'not slow' skips them

# 32 steps per epoch: 40 steps cross an epoch; accumulation and clipping on (the clip bites at this lr).
QUICK = [*RECIPE, "trainer.grad_accum_steps=2", "data.batch_size=16", "trainer.clip_grad_norm=0.5",
         "checkpoint.every=20"]
EXACT = [*QUICK, *float64("recipes.components.mlp.MLP")]  # the runs compared within rounding (tests/rounding.py)
STEPS = 40
FSDP = ["strategy=fsdp", "nproc_per_node=2"]
DDP = ["strategy=ddp", "nproc_per_node=2"]
# charlm at a tiny size: its transformer Blocks are the sharding units (found by default: a ModuleList's layers);
# CHARLM64 in float64, for the runs compared within rounding.
CHARLM = ["recipes/charlm.yaml", "on_cpu=null", "devices=cpu", "precision=fp32", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
          "model.block_size=32", "model.dropout=0.0", "data.batch_size=8", "data.val=null", "trainer.max_steps=12",
          "trainer.grad_accum_steps=2", "trainer.clip_grad_norm=0.5", "trainer.log_every=4", "trainer.eval_every=null",
          "checkpoint.every=6", "logging.tensorboard=false", "logging.memory_plan=false"]
CHARLM64 = [*CHARLM, *float64("recipes.components.gpt.GPT")]
# bf16 under DDP and FSDP (test_bf16_fsdp_gives_the_weights_of_bf16_ddp_bitwise says why no clipping)
BF16 = [*QUICK, "precision=bf16", "trainer.max_steps=20", "checkpoint.every=null", "trainer.clip_grad_norm=null"]
CONSOLIDATE = [*EXACT, *FSDP, "trainer.max_steps=20", "checkpoint.every=10"]


# Validation sets that split into a different number of batches per rank (8 items a rank's batch): 17 items are
# 9 on rank 0 (two batches) and 8 on rank 1 (one); 1 item leaves rank 1 none.
UNEVEN = ["trainer.max_steps=4", "checkpoint.every=null", "logging.jsonl=true",
          f"dist_timeout={round(paced(60))}"]  # a busy machine's healthy waits: longer
UNEVEN_VAL = (17, 1)


def launch(run_dir, *args):
    return run([sys.executable, "-m", "launcher", *args, f"run_dir={run_dir}"], timeout=300)


def here(run_dir, recipe, *args):
    """One process, trained in this one (a fresh process would add its start-up)."""
    from launcher.recipe import load
    from launcher.run.train import train

    train(load(REPO / recipe, [*args, "strategy=single", f"run_dir={run_dir}"]))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    here(folder, *EXACT)
    return folder


@pytest.fixture(scope="module")
def two(tmp_path_factory, single):
    """Every two-process run of this module in one torchrun launch, in this order: (root, rank 0's and rank 1's
    results). The run folder of case NAME is root / NAME."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("fsdp")
    sharded = root / "sharded" / "checkpoints" / "step_20"
    cases = {
        "sharded": [*EXACT, *FSDP],
        "compiled": [*EXACT, *FSDP, "trainer.compile=true", "checkpoint.every=null"],
        "bf16-ddp": [*BF16, *DDP],
        "bf16-fsdp": [*BF16, *FSDP],
        "resumed": [*EXACT, *FSDP, f"checkpoint.resume={sharded}"],
        "resumed-under-ddp": [*EXACT, *DDP, f"checkpoint.resume={sharded}"],
        "resumed-under-tp": [*EXACT, *FSDP, "parallel.tp=2", "parallel.tp_plan={'0': colwise, '2': rowwise}",
                             f"checkpoint.resume={sharded}"],
        "from-one-process": [*EXACT, *FSDP, f"checkpoint.resume={single / 'checkpoints' / 'step_20'}"],
        "ddp-20-steps": [*EXACT, *DDP, "trainer.max_steps=20"],
        "async": [*EXACT, *FSDP, "checkpoint.async_save=true", "checkpoint.every=10"],
        "async-resumed": [*EXACT, *FSDP, f"checkpoint.resume={root / 'async' / 'checkpoints' / 'step_20'}"],
        "charlm": [*CHARLM64, *FSDP, "trainer.activation_checkpointing=[Block]"],
        "consolidate-every": [*CONSOLIDATE, "checkpoint.consolidate=every"],
        "consolidate-never": [*CONSOLIDATE, "checkpoint.consolidate=never"],
        **{f"val-{n}": [*EXACT, *FSDP, *UNEVEN, f"data.val.n={n}"] for n in UNEVEN_VAL},
    }
    ranks = several({name: [*args, f"run_dir={root / name}"] for name, args in cases.items()}, root, timeout=1200)
    return root, ranks


def ran(two, name):
    """Case NAME's run folder and what rank 0 printed; the case ended without an error on both ranks."""
    root, ranks = two
    assert [results[name]["error"] for results in ranks] == [None, None], [results[name] for results in ranks]
    return root / name, ranks[0][name]["said"]


def test_fsdp_gives_the_weights_of_one_process(single, two):
    folder, said = ran(two, "sharded")
    assert "(fsdp)" in said and "fsdp: sharded over 2 ranks; units none (the root alone)" in said
    assert "optimizer: torch.optim.AdamW with fused=True" in said  # on the shards (DTensors) as in one process
    assert_within_rounding(single / "model.pt", folder / "model.pt", STEPS)


def test_compiled_fsdp_gives_the_eager_weights_of_one_process(single, two):
    folder, _ = ran(two, "compiled")
    assert_within_rounding(single / "model.pt", folder / "model.pt", STEPS)


def test_bf16_fsdp_gives_the_weights_of_bf16_ddp_bitwise(two):
    """Parameters computed in bf16 (FSDP's MixedPrecisionPolicy under autocast), gradients accumulated and
    reduced in fp32: DDP's numbers at the same world size, bit for bit. Not with clipping: the norm sums the
    shards in another order, its last bit can differ (3e-8 here after 20 steps), and bf16's rounding of the
    parameters can amplify that (a CPU with native bf16 did, past rtol 1e-5). Against one process, each rank's
    bf16 gradient is rounded before the reduction, under DDP as under FSDP (about 1e-2 apart after 20 steps)."""
    (ddp, _), (fsdp, _) = ran(two, "bf16-ddp"), ran(two, "bf16-fsdp")
    assert_same_weights(ddp / "model.pt", fsdp / "model.pt")


def test_a_sharded_checkpoint_is_dcp_shards_sealed_by_a_manifest(two, tmp_path):
    from launcher import export

    folder, _ = ran(two, "sharded")
    step = folder / "checkpoints" / "step_20"
    names = sorted(p.name for p in step.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]  # consolidate: final
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["format"] == 3 and manifest["sharded"] and manifest["world_size"] == 2
    assert sorted(manifest["files"]) == names[:3]
    assert "model.pt" in {p.name for p in (folder / "checkpoints" / "step_40").iterdir()}
    assert not list((folder / "checkpoints").glob(".step_*"))
    # Both ranks' shards, joined by python -m launcher.export's work in one process (this one): the gathered model.pt
    assert export.main([str(folder / "checkpoints" / "step_40"), str(tmp_path / "e.pt")]) == 0
    assert_same_weights(folder / "model.pt", tmp_path / "e.pt")


def test_resume_at_the_same_world_size_is_bitwise(two):
    folder, _ = ran(two, "sharded")
    resumed, said = ran(two, "resumed")
    assert "resumed from" in said and "resharded" not in said
    assert_same_weights(folder / "model.pt", resumed / "model.pt")


def test_a_sharded_checkpoint_resumes_in_one_process(single, two, tmp_path, capsys):
    folder, _ = ran(two, "sharded")
    capsys.readouterr()
    here(tmp_path, *EXACT, f"checkpoint.resume={folder / 'checkpoints' / 'step_20'}")
    assert "written by 2 processes, resharded to 1" in capsys.readouterr().out
    assert_within_rounding(single / "model.pt", tmp_path / "model.pt", STEPS)


def test_a_sharded_checkpoint_resumes_under_ddp(single, two):
    folder, _ = ran(two, "resumed-under-ddp")
    assert_within_rounding(single / "model.pt", folder / "model.pt", STEPS)


def test_a_sharded_checkpoint_resumes_split_over_tensor_parallel_ranks(single, two):
    """fsdp x 2's shards read by tp x 2: the MLP's first layer split by rows, its second by columns."""
    folder, said = ran(two, "resumed-under-tp")
    assert "parallel.tp: 2 layers split over 2 ranks: 0 (colwise), 2 (rowwise)" in said
    assert_within_rounding(single / "model.pt", folder / "model.pt", STEPS)


def test_a_one_process_checkpoint_resumes_sharded(single, two):
    folder, said = ran(two, "from-one-process")
    assert "written by 1 process, resharded to 2" in said
    assert_within_rounding(single / "model.pt", folder / "model.pt", STEPS)


def test_ddp_resumes_in_one_process(single, two, tmp_path):
    ddp, _ = ran(two, "ddp-20-steps")
    here(tmp_path / "one", *EXACT, f"checkpoint.resume={ddp / 'checkpoints' / 'step_20'}")
    assert_within_rounding(single / "model.pt", tmp_path / "one" / "model.pt", STEPS)


def test_asynchronous_saves_write_the_same_checkpoints(two):
    folder, _ = ran(two, "sharded")
    written, _ = ran(two, "async")
    assert (written / "checkpoints" / "latest").read_text().strip() == "step_40"
    assert_same_weights(folder / "model.pt", written / "model.pt")
    again, _ = ran(two, "async-resumed")  # the asynchronously written step_20 resumes exactly
    assert_same_weights(folder / "model.pt", again / "model.pt")


def test_charlm_blocks_as_units_with_activation_checkpointing(two, tmp_path):
    folder, said = ran(two, "charlm")
    here(tmp_path / "one", *CHARLM64)
    assert "units Block" in said
    assert_within_rounding(tmp_path / "one" / "model.pt", folder / "model.pt", steps=12)


def test_a_unit_the_model_lacks_is_one_line_on_every_rank(tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "launcher", *QUICK, *FSDP, "fsdp.units=[Block]",
                           f"run_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=paced(120))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "fsdp.units: the model has no class Block; its classes: MLP" in done.stderr
    assert "Traceback" not in done.stderr


def test_consolidate_every_and_never(two):
    every, _ = ran(two, "consolidate-every")
    for step in (10, 20):
        assert (every / "checkpoints" / f"step_{step}" / "model.pt").is_file()
    assert_same_weights(every / "model.pt", every / "checkpoints" / "step_20" / "model.pt")
    never, said = ran(two, "consolidate-never")
    assert not list(never.rglob("model.pt"))
    assert "model: not gathered (checkpoint.consolidate=never" in said


def test_fp16_is_refused_with_one_line(tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "launcher", *QUICK, *FSDP, "precision=fp16", f"run_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(120))
    assert done.returncode == 2 and "precision: fp16 needs a grad scaler" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_sharded_checkpoint_of_another_model_names_the_difference_on_every_rank(two, tmp_path, capsys):
    """DCP alone says `CheckpointException ranks:dict_keys([0, 1])`: the first differing key and its
    shapes instead, as for a full checkpoint, under fsdp x2 (launched as a user types it) and in one process
    (python -m launcher's main, in this one)."""
    import subprocess

    from launcher.cli import main

    step = ran(two, "sharded")[0] / "checkpoints" / "step_20"
    expected = [f"launcher: checkpoint.resume: {step} does not fit this run ('0.weight' is (128, 32) in the "
                f"checkpoint, (64, 32) in the model); start over with checkpoint.resume=never"]
    done = subprocess.run([sys.executable, "-m", "launcher", *EXACT, *FSDP, "model.hidden=64",
                           f"checkpoint.resume={step}", f"run_dir={tmp_path / 'fsdp'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(120))
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [x for x in done.stderr.splitlines() if x.startswith("launcher:") or "Traceback" in x]
    assert lines == expected, done.stderr[-2000:]
    capsys.readouterr()
    code = main([*EXACT, "strategy=single", "model.hidden=64", f"checkpoint.resume={step}", f"run_dir={tmp_path / 'one'}"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("launcher:") or "Traceback" in x]
    assert code == 2 and lines == expected, err[-2000:]


@pytest.mark.parametrize("n", UNEVEN_VAL)
def test_a_validation_set_of_uneven_batches_per_rank_is_evaluated_whole(two, tmp_path, n):
    """A rank with a batch fewer ran one forward fewer, and fsdp's all-gathers in the other's last forward waited
    for it until dist_timeout (exit 6). Now it runs a padding batch it does not count: the sharded run's validation
    loss is one process's over the same items."""
    folder, said = ran(two, f"val-{n}")
    here(tmp_path, *EXACT, *UNEVEN, f"data.val.n={n}")

    def val_loss(run_dir):
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [line["val/loss"] for line in lines if "val/loss" in line]

    ours, alone = val_loss(folder), val_loss(tmp_path)
    assert len(ours) == len(alone) == 1 and ours[0] == pytest.approx(alone[0], rel=1e-12), (ours, alone)
