"""Every user mistake ends within seconds with exit 2 and one line on stderr naming the problem:
no traceback, on every rank."""

import builtins
import pickle
import re
import subprocess
import sys
import time

import pytest
import torch

from launcher.checkpoint import full
from launcher.cli import main
from recipes.components.mlp import MLP
from tests.conftest import REPO, SMALL, launch
from tests.pace import paced

Q = "recipes/quickstart.yaml"
NO_PLAN = "logging.memory_plan=false"  # no planner process beside a run that trains; no test here checks its line


def files(tmp):
    """The files some cases point at."""
    (tmp / "broken.yaml").write_text("name: x\nmodel: {_target_: a\n")
    (tmp / "nameless.yaml").write_text((REPO / Q).read_text().replace("name: quickstart\n", ""))
    (tmp / "list.yaml").write_text("- 1\n")
    torch.save(MLP(hidden=64).state_dict(), tmp / "other.pt")
    torch.save(MLP().state_dict(), tmp / "whole.pt")
    (tmp / "truncated.pt").write_bytes((tmp / "whole.pt").read_bytes()[:500])
    (tmp / "step_5").mkdir(exist_ok=True)
    (tmp / "step_5" / "model.pt").write_bytes((tmp / "whole.pt").read_bytes())
    with open(tmp / "evil.pt", "wb") as f:
        pickle.dump({"0.weight": Evil()}, f)
    (tmp / "random.pt").write_bytes(bytes(range(7, 250)) * 9)
    torch.save({"epoch": 3, "global_step": 30}, tmp / "meta.ckpt")
    (tmp / "with_file").mkdir(exist_ok=True)
    (tmp / "with_file" / "checkpoints").write_text("not a folder")
    full.write(tmp / "damaged" / "checkpoints", 1, MLP().state_dict(), {}, keep=1)
    model = tmp / "damaged" / "checkpoints" / "step_1" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 1
    model.write_bytes(bytes(data))
    recipe = (REPO / Q).read_text()
    (tmp / "utf16.yaml").write_bytes(recipe.encode("utf-16"))
    (tmp / "latin1.yaml").write_bytes("# a recipe\nname: caf\xe9\n".encode("latin-1"))
    (tmp / "noise.yaml").write_bytes(bytes(range(256)) * 16)
    (tmp / "deep.yaml").write_text("[" * 100_000)
    (tmp / "huge.yaml").write_text(recipe + "#" * (2 << 20))
    (tmp / "twice.yaml").write_text("name: a\nmodel: {_target_: torch.nn.Linear}\nname: b\n")
    (tmp / "twice_nested.yaml").write_text("name: a\ndata:\n  batch_size: 8\n  train: {n: 1}\n  batch_size: 16\n")


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


# (id, command line after `python -m launcher`, what the one line says); {t} is a scratch folder.
CASES = [
    ("malformed-yaml", ["{t}/broken.yaml"], "broken.yaml:3: not valid YAML"),
    ("not-a-mapping", ["{t}/list.yaml"], "a recipe is a mapping of keys"),
    ("no-file", ["{t}/none.yaml"], "none.yaml: recipe file not found"),
    ("unknown-key", [Q, "trainer.max_step=5"], "trainer.max_step: unknown key; did you mean 'trainer.max_steps'?"),
    ("wrong-type", [Q, "trainer.max_steps=many"], "trainer.max_steps: expected an integer or null, got 'many'"),
    ("missing-value", ["{t}/nameless.yaml"], "name: required value is missing"),
    ("interpolation", [Q, "run_dir=runs/${nope}"], "run_dir: cannot resolve 'runs/${nope}'"),
    ("malformed-override", [Q, "trainer.max_steps"], "expected key=value with a dotted key"),
    ("bad-override-value", [Q, "trainer.max_steps=[1,"], "cannot parse the value"),
    ("no-import", [Q, "model._target_=recipes.components.mlp.Nope"], "has no attribute 'Nope'"),
    ("not-callable", [Q, "model._target_=recipes.components.mlp"], "'recipes.components.mlp' is not callable"),
    ("wrong-arguments", [Q, "model.widht=3"], "model.widht: 'recipes.components.mlp.MLP' takes no argument 'widht'"),
    ("out-of-range", [Q, "trainer.max_steps=0"], "trainer.max_steps: must be 1 or more, got 0"),
    ("bad-choice", [Q, "precision=fp4"], "precision: got 'fp4'; valid: fp32, bf16, fp16, fp8"),
    ("fp8-off-a-gpu", [Q, "precision=fp8", "devices=cpu"],
     "precision: fp8 needs an NVIDIA GPU with fp8 matmuls (compute capability 8.9 or newer: H100, L4, RTX 4090), and "
     "this run is on cpu; use precision=bf16"),
    ("bad-peak", [Q, "logging.peak_tflops=0"], "logging.peak_tflops: must be a positive number of TFLOP/s or null"),
    ("bad-bucket-cap", [Q, "ddp.bucket_cap_mb=-1"], "ddp.bucket_cap_mb: must be a positive number of MiB below 2^43"),
    ("ddp-option-not-a-bool", [Q, "ddp.static_graph=maybe"], "ddp.static_graph: expected true or false, got 'maybe'"),
    ("sync-batchnorm-on-cpu", [Q, "strategy=accelerate", "devices=cpu", "ddp.sync_batchnorm=true"],
     "ddp.sync_batchnorm: needs CUDA devices (SyncBatchNorm has no CPU kernel); this run is on cpu"),
    ("unknown-flag", [Q, "--fast"], "unrecognized arguments: --fast"),
    ("cuda-without-gpu", [Q, "devices=cuda"], "devices: 'cuda' asks for a GPU but none is visible"),
    ("gpu-not-there", [Q, "devices=cuda:3"], "asks for a GPU but none is visible"),
    ("gpu-ids-not-there", [Q, "devices=[0,3]"], "devices: GPU 0 of [0, 3] is not there; visible: none"),
    ("free-gpus-not-there", [Q, "devices=auto:2"], "devices: auto:2 asks for 2 GPU(s), visible: none"),
    ("fp16-on-cpu", [Q, "precision=fp16", "devices=cpu"], "precision: fp16 needs a CUDA device"),
    ("ddp-count-on-cpu", [Q, "strategy=ddp"], "nproc_per_node: strategy=ddp on the CPU"),
    ("prefetch-without-workers", [Q, "data.prefetch_factor=4"],
     "data.prefetch_factor: is what each loader worker makes ahead, and data.num_workers is 0"),
    ("empty-dataset", [Q, "data.train.n=0"], "data.train: the dataset is empty"),
    ("batch-too-large", [Q, "data.batch_size=100000"], "items are fewer than one optimizer step takes"),
    ("items-not-pairs", [Q, "data.train={_target_: tests.components.Singles}"],
     "the recipe's loss takes (input, target) pairs"),
    ("items-wrong-shape", [Q, "model.in_dim=16"], "data.train does not fit the model, loss or metrics"),
    ("more-classes-than-outputs", [Q, "data.train.classes=12"], "IndexError: Target 1"),
    ("another-model", [Q, "checkpoint.init_from={t}/other.pt"], "does not fit this model: '0.weight' is (64, 32)"),
    ("truncated-file", [Q, "checkpoint.init_from={t}/truncated.pt"], "truncated or not a torch file"),
    ("runs-code", [Q, "checkpoint.init_from={t}/evil.pt"], "which could run code when loaded; it is not loaded"),
    ("not-a-checkpoint-folder", [Q, "checkpoint.init_from={t}"], "not a complete checkpoint (no valid manifest.json)"),
    ("missing-manifest", [Q, "checkpoint.resume={t}/step_5"], "is incomplete (no valid manifest.json)"),
    ("no-folder", [Q, "checkpoint.resume={t}/nowhere"], "is not a checkpoint folder"),
    ("run-dir-is-a-file", [Q, "run_dir={t}/whole.pt"], "run_dir: cannot write"),
    ("random-bytes", [Q, "checkpoint.init_from={t}/random.pt"], "not a checkpoint: neither torch's zip format nor a pickle"),
    ("nested-without-weights", [Q, "checkpoint.init_from={t}/meta.ckpt"], "none of state_dict, model, model_state_dict"),
    ("checkpoints-is-a-file", [Q, "run_dir={t}/with_file"], "with_file/checkpoints is a file"),
    ("damaged-checkpoint", [Q, "checkpoint.resume={t}/damaged/checkpoints/step_1"], "step_1 is damaged (model.pt: CRC-32"),
    ("damaged-init-from", [Q, "checkpoint.init_from={t}/damaged/checkpoints/step_1/model.pt"], "damaged: its CRC-32 differs"),
    ("resume-a-system-folder", [Q, "checkpoint.resume=/etc"], "checkpoint.resume: /etc is incomplete (no valid manifest.json)"),
    ("unknown-store", [Q, "checkpoint.dir=nope://bucket/run"],
     "checkpoint.dir: nope://bucket/run: nope:// is not a place for checkpoints; use a local folder"),
    # Recipe files that are not YAML text, and YAML that loses what matters
    ("recipe-utf16", ["{t}/utf16.yaml"], "utf16.yaml: UTF-16 or UTF-32 text; save the recipe as UTF-8"),
    ("recipe-latin1", ["{t}/latin1.yaml"], "latin1.yaml:2: byte 0xe9 is not UTF-8"),
    ("recipe-is-a-checkpoint", ["{t}/whole.pt"], "whole.pt: a zip archive (a torch.save file?), not a YAML recipe"),
    ("recipe-is-noise", ["{t}/noise.yaml"], "noise.yaml: binary data, not a YAML recipe"),
    ("recipe-nests-deep", ["{t}/deep.yaml"], "deep.yaml:1: nested more than 32 levels deep"),
    ("recipe-huge", ["{t}/huge.yaml"], "huge.yaml: more than 1 MiB"),
    ("duplicate-key", ["{t}/twice.yaml"], "twice.yaml:3: name: duplicate key (first at line 1)"),
    ("duplicate-nested-key", ["{t}/twice_nested.yaml"],
     "twice_nested.yaml:5: data.batch_size: duplicate key (first at line 3)"),
    ("override-not-utf8", [Q, "name=caf\udce9"], "override 'name=caf\\udce9': holds bytes that are not UTF-8 text"),
    ("override-nests-deep", [Q, "model.x=" + "[" * 100_000],
     "cannot parse the value: nested more than 32 levels deep"),
    ("override-long-number", [Q, "seed=" + "9" * 5000], "9... (5005 characters)': cannot parse the value"),
    # Numbers out of the range of what consumes them
    ("seed-past-64-bits", [Q, f"seed={2**64}"], f"seed: must fit in 64 bits ({-2**63} to {2**63 - 1}), got {2**64}"),
    ("int-past-64-bits", [Q, f"checkpoint.keep={10**20}"], "checkpoint.keep: must fit in 64 bits"),
    ("workers-absurd", [Q, "data.num_workers=100000"], "data.num_workers: at most 256 loader processes per rank"),
    ("clip-infinite", [Q, "trainer.clip_grad_norm=inf"],
     "trainer.clip_grad_norm: must be a positive number or null, got inf"),
    ("peak-infinite", [Q, "logging.peak_tflops=.inf"], "logging.peak_tflops: must be a positive number of TFLOP/s"),
    ("lr-negative", [Q, "optimizer.lr=-1"],
     "optimizer: torch.optim.AdamW failed with the recipe's arguments: ValueError"),
    ("lr-nan", [Q, "optimizer.lr=.nan"],
     "optimizer: torch.optim.AdamW failed with the recipe's arguments: ValueError"),
    ("name-climbs-out", [Q, "name=.."], "name: got '..'"),
    # Components that are not what their section needs
    ("optimizer-a-list", [Q, "optimizer={_target_: builtins.list}"],
     "optimizer: builtins.list built a list, not a torch.optim.Optimizer"),
    ("optimizer-a-module", [Q, "optimizer={_target_: torch.nn.ParameterList}"], "not a torch.optim.Optimizer"),
    ("schedule-needs-a-metric", [Q, "lr_schedule={_target_: torch.optim.lr_scheduler.ReduceLROnPlateau}"],
     "lr_schedule: torch.optim.lr_scheduler.ReduceLROnPlateau.step() needs metrics; the launcher calls step()"),
    ("schedule-not-a-schedule", [Q, "lr_schedule={_target_: builtins.id}"],
     "lr_schedule: builtins.id built an int, not an LR schedule"),
    ("schedule-too-short", [Q, "lr_schedule={_target_: torch.optim.lr_scheduler.OneCycleLR, max_lr: 0.01, total_steps: 5}"],
     "lr_schedule: fails at step 6: Tried to step 6 times. The specified number of total steps is 5; its length"),
    ("metric-a-float", [Q, "metrics.accuracy={_target_: tests.components.BadMetric, as_: float}"],
     "metrics.accuracy: must return one value per item, a tensor of shape (64, ...) for this batch of 64; got a float"),
    ("metric-a-scalar", [Q, "metrics.accuracy={_target_: tests.components.BadMetric, as_: scalar}"], "got shape ()"),
    ("metric-not-per-item", [Q, "metrics.accuracy={_target_: tests.components.BadMetric, as_: transposed}"],
     "got shape (10, 64)"),
    ("metric-not-callable", [Q, "metrics.accuracy={_target_: builtins.dict}"],
     "metrics.accuracy: builtins.dict built a dict, which cannot be called"),
    ("loss-a-float", [Q, "loss={_target_: tests.components.BadLoss, as_: float}"],
     "loss: must return a scalar tensor (the mean over the batch), got a float"),
    ("loss-per-item", [Q, "loss.reduction=none"],
     "loss: must return a scalar tensor (the mean over the batch), got shape (64,)"),
    ("loss-a-tuple", [Q, "loss={_target_: tests.components.BadLoss, as_: tuple}"], "got a tuple"),
    ("loss-detached", [Q, "loss={_target_: tests.components.BadLoss, as_: detached}"],
     "loss: the torch.float32 it returns does not depend on the model's parameters"),
    ("loss-an-integer", [Q, "loss={_target_: tests.components.BadLoss, as_: count}"],
     "loss: the torch.int64 it returns does not depend"),
    ("loss-not-callable", [Q, "loss={_target_: builtins.dict}"],
     "loss: builtins.dict built a dict, which cannot be called"),
    ("len-of-no-tensors", [Q, "data.train={_target_: torch.utils.data.TensorDataset}"],
     "data.train: len() of TensorDataset fails: tuple index out of range"),
    ("len-negative", [Q, "data.train={_target_: tests.components.Sized, length: -1}"],
     "data.train: len() of Sized fails: __len__() should return >= 0"),
    ("len-a-float", [Q, "data.train={_target_: tests.components.Sized, length: 2.5}"],
     "data.train: len() of Sized fails: 'float' object"),
    ("len-past-an-index", [Q, f"data.train={{_target_: tests.components.Sized, length: {2**70}}}"],
     "data.train: len() of Sized fails: cannot fit"),
    ("val-len-negative", [Q, "data.val={_target_: tests.components.Sized, length: -1}"],
     "data.val: len() of Sized fails"),
    ("model-frozen", [Q, "model={_target_: tests.components.Frozen}"],
     "model: tests.components.Frozen has nothing to train"),
    ("model-without-parameters", [Q, "model={_target_: tests.components.NoParameters}"],
     "has nothing to train (no parameters, or all"),
    ("exits-while-built", [Q, "model={_target_: tests.components.Exits}"],
     "model: tests.components.Exits raised SystemExit(0) while being built; a component must not exit the process"),
    ("exits-in-forward", [Q, "model={_target_: tests.components.Exits, when: forward}"],
     "in forward raised SystemExit(0) during training; a component must not exit the process"),
    ("more-processes-than-cores", [Q, "strategy=ddp", "nproc_per_node=4096", "devices=cpu"],
     "nproc_per_node: 4096 processes on the CPU, but this process may use"),
    # Streams (an IterableDataset, with or without a __len__): counted in steps, at least one batch long
    ("stream-with-max-epochs", [Q, "data.train={_target_: tests.components.SizedStream}", "trainer.max_epochs=1"],
     "trainer.max_epochs: data.train is a stream (SizedStream, an IterableDataset) whose epochs are not counted "
     "ahead; set trainer.max_steps and trainer.max_epochs=null"),
    ("stream-shorter-than-a-batch", [Q, "data.train={_target_: tests.components.Stream, n: 3}"],
     "data.train: the stream ends after 3 items, fewer than one batch (data.batch_size 64)"),
    # _partial_, and overrides onto sections that are null
    ("partial-not-a-bool", [Q, "loss._partial_=yes please"], "loss._partial_: must be true or false, got 'yes please'"),
    ("partial-misspelt-argument", [Q, "loss={_target_: torch.nn.functional.cross_entropy, _partial_: true, "
                                      "label_smothing: 0.1}"],
     "loss.label_smothing: 'torch.nn.functional.cross_entropy' takes no argument 'label_smothing'; did you mean "
     "'label_smoothing'?"),
    ("function-without-partial", [Q, "loss._target_=torch.nn.functional.cross_entropy"],
     "missing a required argument: 'input'; its signature is (input"),
    ("override-onto-null-without-target", [Q, "lr_schedule.step_size=10"],
     "override 'lr_schedule.step_size=10': lr_schedule: needs a _target_ naming an importable callable"),
    ("override-into-a-number", [Q, "seed.x=1"], "seed.x: seed is an integer, not a mapping; set it whole, as seed=..."),
]


@pytest.mark.parametrize("args, says", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_line_exit_2(tmp_path, capsys, args, says):
    files(tmp_path)
    args = [a.replace("{t}", str(tmp_path)) for a in args]
    if args[0] == Q and "run_dir=" not in " ".join(args):
        args.append(f"run_dir={tmp_path / 'run'}")
    used = time.process_time()  # this process's CPU seconds: load does not stretch them, as it does wall time
    try:
        code = main(args)
    except SystemExit as e:  # argparse's errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("launcher: ") and says in lines[0], err
    assert time.process_time() - used < 30  # no unbounded work on the way to the line (~0.01 s)
    assert "this must never run" not in capsys.readouterr().out


SLURM_CASES = [
    ("slurm-unknown-option", ["render", Q, "--node", "2"], "unknown option --node; valid: --nodes, --gpus-per-node"),
    ("slurm-bad-value", ["render", Q, "--nodes", "two"], "--nodes two: expected an integer, got 'two'"),
    ("slurm-bad-layout", ["render", Q, "--layout", "mpi"], "--layout mpi: got 'mpi'; valid: torchrun, srun"),
    ("slurm-bad-time", ["submit", Q, "--time", "soon"], "--time soon: got 'soon'; Slurm's forms"),
    ("slurm-no-command", ["launch", Q], "usage: python -m launcher.slurm {submit,render}"),
]


@pytest.mark.parametrize("args, says", [c[1:] for c in SLURM_CASES], ids=[c[0] for c in SLURM_CASES])
def test_slurm_options_one_line_exit_2(capsys, args, says):
    from launcher.slurm.__main__ import main as slurm_main

    assert slurm_main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("launcher: ") and says in lines[0], lines


@pytest.mark.parametrize("error", ["KeyError", "AttributeError", "AssertionError", "ImportError"])
def test_a_component_that_breaks_keeps_its_traceback_and_is_named(tmp_path, error):
    """A constructor's KeyError, AttributeError, assert or inner import is a bug in that component, not a
    recipe value it rejects (TypeError, ValueError, RuntimeError): its traceback is kept, the key named."""
    with pytest.raises(getattr(builtins, error)) as info:
        main([Q, f"model={{_target_: tests.components.Raises, error: {error}}}", f"run_dir={tmp_path}"])
    if sys.version_info >= (3, 11):  # exception notes
        notes = info.value.__notes__
        assert notes == ["launcher: raised while building model (tests.components.Raises) from the recipe"]


def test_there_are_at_least_25_cases():
    assert len(CASES) + len(SLURM_CASES) >= 25


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB file system (no space) and a read-only one (no permission): root only."""
    full, readonly = tmp_path / "full", tmp_path / "readonly"
    full.mkdir(), readonly.mkdir()
    for folder, options in ((full, "size=64k"), (readonly, "ro,size=64k")):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or 'not root'})")
    yield full, readonly
    for folder in (full, readonly):
        subprocess.run(["umount", str(folder)], capture_output=True)


def test_no_space_or_permission_while_saving(tiny_disk, capsys):
    full, readonly = tiny_disk
    code = main([Q, *SMALL, f"run_dir={full}", "model.hidden=256"])  # the first checkpoint does not fit in 64 KiB
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and "No space left on device (errno 28)" in err[0], err
    assert not list(full.glob("checkpoints/.step_*"))  # the partial save is gone
    code = main([Q, *SMALL, f"run_dir={readonly}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and err == [f"launcher: run_dir: cannot write {readonly}: Read-only file system; "
                                 f"point run_dir=... at a writable folder"]
    # written in the background, the failures are met at the next save: the run trains on, says so, and
    # stops at the third in a row (exit 7), the partial folders gone
    code = main([Q, *SMALL, f"run_dir={full}/async", "model.hidden=256", "checkpoint.async_save=true",
                 "trainer.max_steps=40", "checkpoint.every=10"])
    out, err = capsys.readouterr()
    assert code == 7 and out.count("was not saved (cannot write") == 2, out
    assert err.splitlines() == [f"launcher: checkpoint: 3 saves in a row failed, the last at step 30 (cannot write "
                                f"{full}/async/checkpoints: No space left on device (errno 28); the newest complete "
                                f"checkpoint is kept. HINT: free some space, or point run_dir=... at a writable folder); "
                                f"the run stops. No checkpoint is sealed: the same command starts over"], err
    assert not list(full.glob("async/checkpoints/.step_*"))


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["trainer.max_step=5"], "trainer.max_step: unknown key"),
    (["data.batch_size=33"], "data.batch_size: 33 does not divide among 2 processes; use a multiple of 2"),
    (["data.train.n=0"], "data.train: the dataset is empty"),
    (["model.in_dim=16"], "data.train does not fit the model"),
    (["model={_target_: tests.components.Frozen}"], "model: tests.components.Frozen has nothing to train"),
], ids=["recipe", "batch-not-divisible", "empty-dataset", "wrong-shape", "nothing-to-train"])
def test_the_same_under_torchrun_with_two_processes(tmp_path, args, says):
    done = subprocess.run([sys.executable, "-m", "launcher", Q, "strategy=ddp", "nproc_per_node=2",
                           f"run_dir={tmp_path}", "logging.tensorboard=false", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(120))
    assert done.returncode == 2, done.stderr[-2000:]
    ours = [l for l in done.stderr.splitlines() if "launcher:" in l]
    assert len(ours) == 1 and says in ours[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def ddp2(*args: str) -> subprocess.CompletedProcess:
    """`python -m launcher` starting torchrun with two processes (gloo), as a user types it."""
    return subprocess.run([sys.executable, "-m", "launcher", Q, "strategy=ddp", "nproc_per_node=2", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(120))


def assert_one_line(done: subprocess.CompletedProcess, says: str) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    ours = [l for l in done.stderr.splitlines() if "launcher:" in l]
    assert len(ours) == 1 and ours[0].startswith("launcher: ") and says in ours[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [  # checkpoint.resume=/etc: the next test, three times
    (["run_dir={t}/file"], "run_dir: cannot write {t}/file: File exists"),
    (["run_dir={t}/run", "logging.tensorboard=true"], "logging.tensorboard: cannot write {t}/run/tensorboard: "
                                                       "File exists (errno 17)"),
], ids=["run-dir-is-a-file", "tensorboard-folder-is-a-file"])
def test_a_mistake_only_rank_0_meets_stops_every_rank_with_one_line(tmp_path, args, says):
    """Rank 0 alone writes and decides the resume; the others learn of its mistake in the same collective,
    instead of dying with gloo's traceback while rank 0 exits 2."""
    (tmp_path / "file").write_text("")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tensorboard").write_text("")
    args = [a.replace("{t}", str(tmp_path)) for a in args]
    done = ddp2(f"run_dir={tmp_path / 'run'}", "logging.tensorboard=false", *args)
    assert_one_line(done, says.replace("{t}", str(tmp_path)))


@pytest.mark.slow
def test_the_exit_code_of_one_rank_s_mistake_is_always_2(tmp_path):
    """A mistake rank 0 alone meets (it decides the resume): it raced between 1 (the rank that died in a
    collective) and 2; now every rank agrees, every time."""
    for _ in range(3):
        assert_one_line(ddp2(f"run_dir={tmp_path}", "logging.tensorboard=false", "checkpoint.resume=/etc"),
                        "checkpoint.resume: /etc is incomplete (no valid manifest.json)")


@pytest.mark.slow
def test_no_space_or_permission_under_ddp_with_two_processes(tiny_disk):
    full, readonly = tiny_disk
    done = ddp2(f"run_dir={full}", "logging.tensorboard=false", "model.hidden=256", "trainer.max_steps=20",
                "checkpoint.every=10", NO_PLAN)  # rank 0's save fails; rank 1 learns of it in the save's agreement
    assert_one_line(done, f"cannot write {full}/checkpoints: No space left on device (errno 28)")
    assert not list(full.glob("checkpoints/.step_*"))
    assert_one_line(ddp2(f"run_dir={readonly}", "logging.tensorboard=false"),
                    f"run_dir: cannot write {readonly}: Read-only file system")


def leave_free(folder, size: int) -> None:
    """Fill the file system of `folder` but `size` bytes."""
    import os

    stat = os.statvfs(folder)
    (folder / "filler").write_bytes(b"x" * (stat.f_bavail * stat.f_frsize - size))


def test_a_full_disk_while_tensorboard_writes(tiny_disk, capsys):
    """Its writer thread meets the full disk: the next log step drops TensorBoard with one line naming the
    folder, and training goes on to the end (it used to stop there, unsaved), where the disk, still full,
    refuses the final save with one line."""
    full, _ = tiny_disk
    leave_free(full, 16384)  # the recipe and TensorBoard's first pages; the scalars fill the rest
    code = main([Q, *SMALL, f"run_dir={full}/run", "logging.tensorboard=true", "trainer.max_steps=400",
                 "trainer.log_every=1"])
    out, err = capsys.readouterr()
    dropped = re.findall(rf"^logging.tensorboard: cannot write {full}/run/tensorboard: No space left on device "
                         rf"\(errno 28\); dropped at step (\d+), training goes on without it$", out, re.M)
    assert len(dropped) == 1 and "step 400/400" in out, out[-3000:]
    assert code == 2 and err.splitlines() == [f"launcher: cannot write {full}/run/checkpoints: No space left on device "
                                              f"(errno 28); the newest complete checkpoint is kept. HINT: free some "
                                              f"space, or point run_dir=... at a writable folder"], err


@pytest.mark.slow
def test_a_full_disk_while_tensorboard_writes_under_ddp_drops_it_on_rank_0_alone(tiny_disk):
    """Rank 0's logger fails between two collectives: it is dropped there, and both ranks train on to the
    final save, which the full disk refuses on rank 0; rank 1 learns of it in the save's agreement. The
    same outcome, three times."""
    full, _ = tiny_disk
    for _ in range(3):
        subprocess.run(["rm", "-rf", str(full / "run"), str(full / "filler")], check=True)
        leave_free(full, 16384)
        done = ddp2(*SMALL, f"run_dir={full}/run", "logging.tensorboard=true", "trainer.max_steps=400",
                    "trainer.log_every=1", NO_PLAN)
        assert "; dropped at step " in done.stdout and "step 400/400" in done.stdout, done.stdout[-3000:]
        assert_one_line(done, f"cannot write {full}/run/checkpoints: No space left on device (errno 28)")


@pytest.mark.slow
def test_torchrun_s_own_report_carries_our_line(tmp_path):
    """Plain torchrun: its ChildFailedError report shows our line (from the worker's error file) where it
    would say "To enable traceback see ..."; torchrun itself still exits 1 with its own traceback."""
    for args, says in ((["checkpoint.resume=/etc"], "checkpoint.resume: /etc is incomplete"),
                       (["trainer.max_step=5"], "trainer.max_step: unknown key")):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "launcher", Q, f"run_dir={tmp_path}", "logging.tensorboard=false", *args],
                              cwd=REPO, capture_output=True, text=True, timeout=paced(120))
        err = done.stderr
        assert done.returncode == 1, err[-3000:]  # torchrun's code for any failed worker
        ours = [l for l in err.splitlines() if l.startswith("launcher:") or l.startswith("[rank")]
        assert len(ours) == 1 and says in ours[0], err[-3000:]  # said once, by rank 0; no worker traceback
        root = [l for l in err[err.index("Root Cause"):].splitlines() if "traceback :" in l]
        assert root[0].startswith("  traceback : launcher: ") and says in root[0], err[-3000:]
        assert "To enable traceback" not in err, err[-3000:]


ENV_CASES = [
    ("rank-alone", {"RANK": "1"}, [], "[rank 1] launcher: environment: RANK=1 is set but WORLD_SIZE is not"),
    ("world-size-alone", {"WORLD_SIZE": "2"}, [], "launcher: environment: WORLD_SIZE=2 is set but RANK is not"),
    ("no-master", {"RANK": "1", "WORLD_SIZE": "2"}, [],
     "[rank 1] launcher: environment: WORLD_SIZE=2 says several processes, but MASTER_ADDR and MASTER_PORT are not set"),
    ("recipe-on-rank-1-by-hand", {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     ["trainer.max_step=5"], "[rank 1] launcher: override 'trainer.max_step=5': trainer.max_step: unknown key"),
    ("accumulation-not-a-number", {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "abc"}, ["strategy=accelerate"],
     "launcher: environment variable ACCELERATE_GRADIENT_ACCUMULATION_STEPS='abc' is not a positive integer"),
    ("accumulation-zero", {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "0"}, ["strategy=accelerate"],
     "launcher: environment variable ACCELERATE_GRADIENT_ACCUMULATION_STEPS='0' is not a positive integer"),
    ("accelerate-cpu-not-a-flag", {"ACCELERATE_USE_CPU": "maybe"}, ["strategy=accelerate"],
     "launcher: environment variable ACCELERATE_USE_CPU='maybe' is not a truth value"),
    ("a-flag-accelerate-refuses", {"ACCELERATE_DEBUG_MODE": "x"}, ["strategy=accelerate"],
     "launcher: accelerate refused its environment (invalid truth value x); check ACCELERATE_DEBUG_MODE='x'"),
]


@pytest.mark.parametrize("env, args, says", [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES])
def test_environment_set_by_hand_wrong_or_partial(tmp_path, env, args, says):
    """Variables torchrun (or accelerate launch) sets, set by hand: one line naming the variable, exit 2;
    a rank other than 0 says it too, prefixed, since no rank 0 is there to say it for it."""
    if "strategy=accelerate" in args:
        pytest.importorskip("accelerate")
    done = launch(Q, f"run_dir={tmp_path}", *args, env=env)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr[-3000:]
    assert done.stderr.startswith(says), done.stderr[-3000:]


def test_an_occupied_master_port_names_it(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = launch(Q, "strategy=ddp", "devices=cpu", f"run_dir={tmp_path}",
                      env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert done.returncode == 2 and done.stderr.strip() == (
        f"launcher: environment: MASTER_PORT={port} is in use on this machine, so rank 0 cannot wait there for the "
        f"others; pick a free port for every rank, or start with torchrun --standalone, which finds one"), done.stderr



@pytest.mark.slow  # a longer run: left out of the fast tier (-m "not slow")
def test_a_device_or_a_fifo_named_as_a_checkpoint_is_one_line(tmp_path):
    """/dev/zero read as a checkpoint would fill the memory, a FIFO would block: refused before a read. The
    commands run one after another in one process (tests/commands_in_one_process.py: torch imported once), held
    to 4 GiB of address space and 60 s (on a quiet machine: tests/pace.py), so a regression fails instead of taking the machine."""
    import json
    import os
    import resource

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    commands = []
    for target in ("/dev/zero", fifo):
        commands += [["launcher", Q, *SMALL, f"run_dir={tmp_path}", f"checkpoint.init_from={target}"],
                     ["launcher.export", str(target), str(tmp_path / "out.pt")],
                     ["launcher", Q, *SMALL, f"run_dir={tmp_path}", f"checkpoint.resume={target}"]]
    (tmp_path / "cases.json").write_text(json.dumps([[str(a) for a in c] for c in commands]))
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # noqa: E731
    done = subprocess.run([sys.executable, "tests/commands_in_one_process.py", str(tmp_path / "cases.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=paced(60), preexec_fn=limit)
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(outcomes) == len(commands), done.stdout[-2000:]

    def last_line(outcome):
        assert outcome["code"] == 2, outcome["stderr"][-2000:]
        return outcome["stderr"].strip().splitlines()[-1]

    for (target, kind), (init_from, export, resume) in zip((("/dev/zero", "a character device"), (fifo, "a FIFO")),
                                                           (outcomes[:3], outcomes[3:])):
        said = f"{target}: is {kind}, not a file or a folder"
        assert last_line(init_from) == \
            f"launcher: checkpoint.init_from: {said}; name a state_dict file, a checkpoint folder or a run folder"
        assert last_line(export).startswith(f"launcher: {said}")
        assert "is not a checkpoint folder" in last_line(resume)
