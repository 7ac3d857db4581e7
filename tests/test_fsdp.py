"""Strategy fsdp over real torchrun processes (gloo on the CPU): the weights of one process, and sharded
checkpoints that resume exactly at the same world size and closely at any other, under any strategy."""

import json
import sys

import pytest
import torch

from tests.conftest import assert_same_weights, state_dict
from tests.test_strategies import RECIPE, run

pytestmark = pytest.mark.slow  # real torchrun / multi-process runs: python -m pytest -m 'not slow' skips them

# 32 steps per epoch: 40 steps cross an epoch; accumulation and clipping on (the clip bites at this lr).
QUICK = [*RECIPE, "trainer.grad_accum_steps=2", "data.batch_size=16", "trainer.clip_grad_norm=0.5",
         "checkpoint.every=20"]
FSDP = ["strategy=fsdp", "nproc_per_node=2"]
DDP = ["strategy=ddp", "nproc_per_node=2"]
# charlm at a tiny size: its transformer Blocks are the sharding units (found by default: a ModuleList's layers).
CHARLM = ["recipes/charlm.yaml", "on_cpu=null", "devices=cpu", "precision=fp32", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
          "model.block_size=32", "model.dropout=0.0", "data.batch_size=8", "data.val=null", "trainer.max_steps=12",
          "trainer.grad_accum_steps=2", "trainer.clip_grad_norm=0.5", "trainer.log_every=4", "trainer.eval_every=null",
          "checkpoint.every=6", "logging.tensorboard=false"]


def launch(run_dir, *args):
    return run([sys.executable, "-m", "launcher", *args, f"run_dir={run_dir}"], timeout=300)


def assert_close(a, b, rtol=1e-5, atol=1e-6) -> None:
    a, b = state_dict(a), state_dict(b)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=rtol, atol=atol, msg=f"{key} differs")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    launch(folder, *QUICK, "strategy=single")
    return folder


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    done = launch(folder, *QUICK, *FSDP)
    return folder, done.stdout


def test_fsdp_gives_the_weights_of_one_process(single, sharded):
    folder, said = sharded
    assert "(fsdp)" in said and "fsdp: sharded over 2 ranks; units none (the root alone)" in said
    assert "optimizer: torch.optim.AdamW with fused=True" in said  # on the shards (DTensors) as in one process
    assert_close(single / "model.pt", folder / "model.pt")


def test_compiled_fsdp_gives_the_eager_weights_of_one_process(single, tmp_path):
    launch(tmp_path, *QUICK, *FSDP, "trainer.compile=true", "checkpoint.every=null")
    assert_close(single / "model.pt", tmp_path / "model.pt")


def test_bf16_fsdp_gives_the_weights_of_bf16_ddp_bitwise(tmp_path):
    """Parameters computed in bf16 (FSDP's MixedPrecisionPolicy under autocast), gradients accumulated and
    reduced in fp32: DDP's numbers at the same world size, bit for bit. Not with clipping: the norm sums the
    shards in another order, its last bit can differ (3e-8 here after 20 steps), and bf16's rounding of the
    parameters can amplify that (a CPU with native bf16 did, past rtol 1e-5). Against one process, each rank's
    bf16 gradient is rounded before the reduction, under DDP as under FSDP (about 1e-2 apart after 20 steps)."""
    short = [*QUICK, "precision=bf16", "trainer.max_steps=20", "checkpoint.every=null", "trainer.clip_grad_norm=null"]
    launch(tmp_path / "ddp", *short, *DDP)
    launch(tmp_path / "fsdp", *short, *FSDP)
    assert_same_weights(tmp_path / "ddp" / "model.pt", tmp_path / "fsdp" / "model.pt")


def test_a_sharded_checkpoint_is_dcp_shards_sealed_by_a_manifest(sharded):
    folder, _ = sharded
    step = folder / "checkpoints" / "step_20"
    names = sorted(p.name for p in step.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]  # consolidate: final
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["format"] == 3 and manifest["sharded"] and manifest["world_size"] == 2
    assert sorted(manifest["files"]) == names[:3]
    assert "model.pt" in {p.name for p in (folder / "checkpoints" / "step_40").iterdir()}
    assert not list((folder / "checkpoints").glob(".step_*"))
    # Both ranks' shards, joined by python -m launcher.export in one process: the gathered model.pt
    run([sys.executable, "-m", "launcher.export", str(folder / "checkpoints" / "step_40"), str(folder / "e.pt")])
    assert_same_weights(folder / "model.pt", folder / "e.pt")


def test_resume_at_the_same_world_size_is_bitwise(sharded, tmp_path):
    folder, _ = sharded
    done = launch(tmp_path, *QUICK, *FSDP, f"checkpoint.resume={folder / 'checkpoints' / 'step_20'}")
    assert "resumed from" in done.stdout and "resharded" not in done.stdout
    assert_same_weights(folder / "model.pt", tmp_path / "model.pt")


def test_a_sharded_checkpoint_resumes_in_one_process(single, sharded, tmp_path):
    folder, _ = sharded
    done = launch(tmp_path, *QUICK, "strategy=single", f"checkpoint.resume={folder / 'checkpoints' / 'step_20'}")
    assert "written by 2 processes, resharded to 1" in done.stdout
    assert_close(single / "model.pt", tmp_path / "model.pt")


def test_a_sharded_checkpoint_resumes_under_ddp(single, sharded, tmp_path):
    folder, _ = sharded
    launch(tmp_path, *QUICK, *DDP, f"checkpoint.resume={folder / 'checkpoints' / 'step_20'}")
    assert_close(single / "model.pt", tmp_path / "model.pt")


def test_a_sharded_checkpoint_resumes_split_over_tensor_parallel_ranks(single, sharded, tmp_path):
    """fsdp x 2's shards read by tp x 2: the MLP's first layer split by rows, its second by columns."""
    folder, _ = sharded
    done = launch(tmp_path, *QUICK, *FSDP, "parallel.tp=2", "parallel.tp_plan={'0': colwise, '2': rowwise}",
                  f"checkpoint.resume={folder / 'checkpoints' / 'step_20'}")
    assert "parallel.tp: 2 layers split over 2 ranks: 0 (colwise), 2 (rowwise)" in done.stdout
    assert_close(single / "model.pt", tmp_path / "model.pt")


def test_a_one_process_checkpoint_resumes_sharded(single, tmp_path):
    done = launch(tmp_path, *QUICK, *FSDP, f"checkpoint.resume={single / 'checkpoints' / 'step_20'}")
    assert "written by 1 process, resharded to 2" in done.stdout
    assert_close(single / "model.pt", tmp_path / "model.pt")


def test_ddp_resumes_in_one_process(single, tmp_path):
    ddp = tmp_path / "ddp"
    launch(ddp, *QUICK, *DDP, "trainer.max_steps=20")
    launch(tmp_path / "one", *QUICK, "strategy=single", f"checkpoint.resume={ddp / 'checkpoints' / 'step_20'}")
    assert_close(single / "model.pt", tmp_path / "one" / "model.pt")


def test_asynchronous_saves_write_the_same_checkpoints(sharded, tmp_path):
    folder, _ = sharded
    launch(tmp_path, *QUICK, *FSDP, "checkpoint.async_save=true", "checkpoint.every=10")
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_40"
    assert_same_weights(folder / "model.pt", tmp_path / "model.pt")
    again = tmp_path / "again"  # the asynchronously written step_20 resumes exactly
    launch(again, *QUICK, *FSDP, f"checkpoint.resume={tmp_path / 'checkpoints' / 'step_20'}")
    assert_same_weights(folder / "model.pt", again / "model.pt")


def test_charlm_blocks_as_units_with_activation_checkpointing(tmp_path):
    launch(tmp_path / "one", *CHARLM, "strategy=single")
    done = launch(tmp_path / "fsdp", *CHARLM, *FSDP, "trainer.activation_checkpointing=[Block]")
    assert "units Block" in done.stdout
    assert_close(tmp_path / "one" / "model.pt", tmp_path / "fsdp" / "model.pt")


def test_a_unit_the_model_lacks_is_one_line_on_every_rank(tmp_path):
    import subprocess

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "-m", "launcher", *QUICK, *FSDP, "fsdp.units=[Block]",
                           f"run_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "fsdp.units: the model has no class Block; its classes: MLP" in done.stderr
    assert "Traceback" not in done.stderr


def test_consolidate_every_and_never(tmp_path):
    short = [*QUICK, *FSDP, "trainer.max_steps=20", "checkpoint.every=10"]
    launch(tmp_path / "every", *short, "checkpoint.consolidate=every")
    for step in (10, 20):
        assert (tmp_path / "every" / "checkpoints" / f"step_{step}" / "model.pt").is_file()
    assert_same_weights(tmp_path / "every" / "model.pt", tmp_path / "every" / "checkpoints" / "step_20" / "model.pt")
    done = launch(tmp_path / "never", *short, "checkpoint.consolidate=never")
    assert not list((tmp_path / "never").rglob("model.pt"))
    assert "model: not gathered (checkpoint.consolidate=never" in done.stdout


def test_fp16_is_refused_with_one_line(tmp_path):
    import subprocess

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "-m", "launcher", *QUICK, *FSDP, "precision=fp16", f"run_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "precision: fp16 needs a grad scaler" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_sharded_checkpoint_of_another_model_names_the_difference_on_every_rank(sharded, tmp_path):
    """DCP alone says `CheckpointException ranks:dict_keys([0, 1])`: the first differing key and its
    shapes instead, as for a full checkpoint, under fsdp x2 and in one process."""
    import subprocess

    from tests.conftest import REPO

    step = sharded[0] / "checkpoints" / "step_20"
    for how in (FSDP, ["strategy=single"]):
        done = subprocess.run([sys.executable, "-m", "launcher", *QUICK, *how, "model.hidden=64",
                               f"checkpoint.resume={step}", f"run_dir={tmp_path}"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = [x for x in done.stderr.splitlines() if x.startswith("launcher:") or "Traceback" in x]
        assert lines == [f"launcher: checkpoint.resume: {step} does not fit this run ('0.weight' is (128, 32) in the "
                         f"checkpoint, (64, 32) in the model); start over with checkpoint.resume=never"], done.stderr[-2000:]
