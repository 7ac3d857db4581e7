"""The recipe's ddp section: DDP's options reach DistributedDataParallel (strategy ddp) and Accelerate's DDP;
DDP's unused-parameter error is one line naming the key; SyncBatchNorm needs CUDA."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from launcher.recipe.ranks import DDPConfig
from launcher.placement.scheduler import Placement
from launcher.strategies import create
from launcher.strategies.ddp import options, unused_parameters, with_sync_batchnorm
from tests.components_ddp import UnusedHead, WithBatchNorm
from tests.conftest import REPO, SMALL, state_dict
from tests.pace import paced
from tests.test_strategies import ACCELERATE, EXACT, RECIPE, TORCHRUN, assert_equivalent, free_port, run

UNUSED = "model._target_=tests.components_ddp.UnusedHead"
SHORT = [*SMALL, "trainer.max_steps=10", "data.val.n=64"]
LINE = ("launcher: ddp.find_unused_parameters: aux.weight, aux.bias received no gradient in a step, and DDP waits "
        "for every parameter's; set ddp.find_unused_parameters=true (or make every parameter reach the loss, or "
        "freeze the unused ones with requires_grad=False)")


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone: DDP wraps and reduces as with more."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def torch_unused_error() -> RuntimeError:
    """The error DDP itself raises for a parameter that got no gradient (at the next forward)."""
    wrapped = nn.parallel.DistributedDataParallel(UnusedHead())
    for _ in range(2):
        try:
            wrapped(torch.randn(4, 32)).sum().backward()
        except RuntimeError as e:
            return e
    raise AssertionError("DDP raised nothing for an unused parameter")


@pytest.mark.parametrize("ddp, expected", [
    (DDPConfig(), {"find_unused_parameters": False, "static_graph": False, "gradient_as_bucket_view": False}),
    (DDPConfig(find_unused_parameters=True, static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=0.5),
     {"find_unused_parameters": True, "static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 0.5}),
], ids=["defaults", "all-set"])
def test_options_are_ddps_keywords(ddp, expected):
    assert options(ddp) == expected  # bucket_cap_mb null: torch's default, not passed


@pytest.mark.filterwarnings("ignore:You passed find_unused_parameters=true")  # torch: redundant with a static graph
def test_the_ddp_strategy_wraps_with_the_recipes_options(one_process_group):
    ddp = DDPConfig(find_unused_parameters=True, static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=2)
    wrapped = create("ddp", Placement(launched_by="torchrun"), ddp).wrap(UnusedHead())
    assert (wrapped.find_unused_parameters, wrapped.static_graph, wrapped.gradient_as_bucket_view) == (True, True, True)
    assert wrapped.bucket_bytes_cap == 2 * 2**20
    default = create("ddp", Placement(launched_by="torchrun")).wrap(UnusedHead())
    assert (default.find_unused_parameters, default.static_graph, default.gradient_as_bucket_view) == (False,) * 3
    assert default.bucket_bytes_cap == nn.parallel.DistributedDataParallel(UnusedHead()).bucket_bytes_cap


def test_the_accelerate_strategy_hands_them_to_accelerates_ddp():
    pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
    ddp = DDPConfig(find_unused_parameters=True, static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=8)
    strategy = create("accelerate", Placement(), ddp)
    strategy.setup()
    try:
        assert strategy.accelerator.ddp_handler.to_kwargs() == {
            "find_unused_parameters": True, "static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 8}
    finally:
        strategy.teardown()


def test_the_unused_parameter_error_becomes_one_line_naming_them(one_process_group):
    error = torch_unused_error()
    assert "find_unused_parameters" in str(error) and len(str(error).splitlines()) > 3  # torch's own wall
    assert "launcher: " + unused_parameters(error, UnusedHead(), DDPConfig()) == LINE
    without_model = unused_parameters(error, None, DDPConfig())
    assert without_model.startswith("ddp.find_unused_parameters: some of the model's parameters received no gradient")
    # Already set, the same words mean something else: torch's message and traceback stay
    assert unused_parameters(error, UnusedHead(), DDPConfig(find_unused_parameters=True)) is None
    assert unused_parameters(RuntimeError("CUDA out of memory"), UnusedHead(), DDPConfig()) is None
    assert unused_parameters(ValueError("find_unused_parameters"), UnusedHead(), DDPConfig()) is None


@pytest.mark.parametrize("name", ["ddp", "accelerate"])
def test_a_static_graph_with_accumulation_is_refused(name):
    if name == "accelerate":
        pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
    strategy = create(name, Placement(launched_by="torchrun"), DDPConfig(static_graph=True))
    assert strategy.settle("fp32", 1)[:2] == ("fp32", 1)
    from launcher.errors import UserError

    with pytest.raises(UserError, match=r"^ddp.static_graph: torch's DDP fails with a static graph when gradients "
                                        r"accumulate \(trainer.grad_accum_steps=2 skips their sync"):
        strategy.settle("fp32", 2)
    assert create(name, Placement(launched_by="torchrun")).settle("fp32", 2)[:2] == ("fp32", 2)


def test_torch_still_fails_a_static_graph_under_no_sync(one_process_group):
    """Why the launcher refuses ddp.static_graph with accumulation. When this fails, torch is fixed: drop
    ddp.refuse_static_graph_with_accumulation and check the equivalence test below with accumulation."""
    wrapped = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), static_graph=True)
    with pytest.raises(RuntimeError, match="expect_autograd_hooks_"):
        with wrapped.no_sync():
            wrapped(torch.randn(2, 4)).sum().backward()


@pytest.mark.parametrize("name", ["single", "dp"])
def test_one_process_strategies_explain_nothing(name):
    assert create(name, Placement()).explain(RuntimeError("... find_unused_parameters=True ...")) is None


def test_sync_batchnorm_keeps_the_parameters_and_the_keys():
    model = WithBatchNorm()
    plain_keys, weight = list(model.state_dict()), model[1].weight
    converted = with_sync_batchnorm(model, DDPConfig(sync_batchnorm=True))
    assert isinstance(converted[1], nn.SyncBatchNorm) and converted[1].weight is weight  # the optimizer's tensors
    assert list(converted.state_dict()) == plain_keys
    WithBatchNorm().load_state_dict(converted.state_dict(), strict=True)
    untouched = WithBatchNorm()
    assert with_sync_batchnorm(untouched, DDPConfig()) is untouched and type(untouched[1]) is nn.BatchNorm1d


@pytest.mark.parametrize("name", ["ddp", "accelerate"])
def test_sync_batchnorm_on_the_cpu_is_refused_before_anything_starts(name):
    from launcher.errors import UserError

    if name == "accelerate":
        pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
    strategy = create(name, Placement(launched_by="torchrun"), DDPConfig(sync_batchnorm=True))
    with pytest.raises(UserError) as raised:
        strategy.setup()
    assert raised.value.problems == ["ddp.sync_batchnorm: needs CUDA devices (SyncBatchNorm has no CPU kernel); "
                                     "this run is on cpu: set ddp.sync_batchnorm=false to train here"]
    assert not dist.is_initialized()


@pytest.mark.parametrize("name, says", [
    ("single", "ddp.sync_batchnorm: one process has no other to share BatchNorm statistics with"),
    ("dp", "ddp.sync_batchnorm: one process has no other"),  # without two GPUs dp is one process on one device
])
def test_sync_batchnorm_in_one_process_is_a_note(name, says):
    if name == "dp" and torch.cuda.device_count() >= 2:
        says = "ddp.sync_batchnorm: DataParallel cannot synchronise BatchNorm"
    notes = create(name, Placement(), DDPConfig(sync_batchnorm=True)).notes()
    assert any(n.startswith(says) for n in notes), notes
    assert not any("sync_batchnorm" in n for n in create(name, Placement()).notes())


# Real processes: torchrun with two workers (gloo on the CPU), as a user starts them


def ddp2(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "recipes/quickstart.yaml", "strategy=ddp",
                           "nproc_per_node=2", *SHORT, f"run_dir={tmp_path}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(180))


def accelerate2(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ACCELERATE, "--multi_gpu", "--num_processes=2", "--num_machines=1", "--mixed_precision=no",
                           "--dynamo_backend=no", f"--main_process_port={free_port()}", "-m", "launcher",
                           "recipes/quickstart.yaml", *SHORT, f"run_dir={tmp_path}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(180))


# DDP's options that must keep the single-process weights, by the test's id
OPTIONS = {
    # and checkpoints written by rank 0 in the background (checkpoint.async_save), which train nothing differently
    "static-graph-async-saves": ["ddp.static_graph=true", "checkpoint.async_save=true", "checkpoint.every=10",
                                 "checkpoint.keep=4"],
    # half the batch twice: the micro-steps skip sync, into gradients that are views of small buckets
    "bucket-views-accumulating": ["ddp.gradient_as_bucket_view=true", "ddp.bucket_cap_mb=0.01",
                                  "ddp.find_unused_parameters=true", "data.batch_size=16", "trainer.grad_accum_steps=2"],
}


def ours(stderr: str) -> list:
    """The workers' own lines (torchrun's report, when there is one, is indented after them)."""
    return [line for line in stderr.splitlines() if line.startswith(("launcher:", "[rank"))]


@pytest.mark.slow
def test_ddp_unused_parameters_is_one_line_on_rank_0(tmp_path):
    done = ddp2(tmp_path, UNUSED)
    assert done.returncode == 2, done.stderr[-3000:]
    assert ours(done.stderr) == [LINE], done.stderr[-3000:]
    assert [l for l in done.stderr.splitlines() if "find_unused_parameters" in l] == [LINE]
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The two-process runs that train, one after another in one torchrun launch (tests/several_runs.py) as
    `torchrun -m launcher` would run each: (root, each rank's results); case NAME's run folder is root / NAME."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("ddp_options")
    cases = {"unused-allowed": ["recipes/quickstart.yaml", "strategy=ddp", *SHORT, UNUSED, "ddp.find_unused_parameters=true"],
             **{name: [*EXACT, *options] for name, options in OPTIONS.items()}}
    return root, several({name: [*args, f"run_dir={root / name}"] for name, args in cases.items()}, root, timeout=600)


def ran(two, name):
    """Case NAME's run folder; the case ended without an error on both ranks."""
    root, ranks = two
    assert [results[name]["error"] for results in ranks] == [None, None], [results[name] for results in ranks]
    return root / name


@pytest.mark.slow
def test_ddp_unused_parameters_allowed_trains(two):
    UnusedHead().load_state_dict(state_dict(ran(two, "unused-allowed") / "model.pt"), strict=True)


@pytest.mark.slow
def test_accelerate_honours_find_unused_parameters(tmp_path):
    pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
    refused = accelerate2(tmp_path / "refused", UNUSED)
    # accelerate launch reports its workers' failure with its own traceback (its process, not ours); the
    # worker's exit code is in that report, its line on stderr once
    assert refused.returncode != 0 and "exitcode  : 2" in refused.stderr, refused.stderr[-3000:]
    assert ours(refused.stderr) == [LINE], refused.stderr[-3000:]
    assert str(REPO / "launcher") not in refused.stderr
    done = accelerate2(tmp_path / "allowed", UNUSED, "ddp.find_unused_parameters=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(accelerate)" in done.stdout


@pytest.mark.slow
def test_ddp_sync_batchnorm_on_the_cpu_exits_2_with_one_line(tmp_path):
    done = ddp2(tmp_path, "ddp.sync_batchnorm=true")
    assert done.returncode == 2, done.stderr[-3000:]
    assert ours(done.stderr) == ["launcher: ddp.sync_batchnorm: needs CUDA devices (SyncBatchNorm has no CPU "
                                 "kernel); this run is on cpu: set ddp.sync_batchnorm=false to train here"]
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process weights (tests/test_strategies.py's reference run), trained in this process."""
    from launcher.recipe import load
    from launcher.run.train import train

    folder = tmp_path_factory.mktemp("single")
    train(load(REPO / EXACT[0], [*EXACT[1:], f"run_dir={folder}", "strategy=single"]))
    return folder / "model.pt"


@pytest.mark.slow
@pytest.mark.parametrize("options", list(OPTIONS))
def test_ddp_options_keep_the_single_process_weights(reference, two, options):
    """They change how DDP reduces, not what."""
    from launcher.checkpoint import layout, manifest

    folder = ran(two, options)
    assert_equivalent(reference, folder / "model.pt")
    if "checkpoint.async_save=true" in OPTIONS[options]:
        sealed = layout.complete(folder / "checkpoints")
        assert [p.name for p in sealed] == ["step_10", "step_20", "step_30", "step_40"]
        assert all(manifest.verify(p) is None for p in sealed)
        assert_equivalent(reference, sealed[-1] / "model.pt")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_sync_batchnorm_on_cuda_trains_and_saves_the_plain_keys(tmp_path):
    run([*TORCHRUN, "--standalone", f"--nproc_per_node={min(torch.cuda.device_count(), 2)}", "-m", "launcher",
         *RECIPE, f"run_dir={tmp_path}", "model={_target_: tests.components_ddp.WithBatchNorm}",
         "ddp.sync_batchnorm=true", "devices=cuda"])
    WithBatchNorm().load_state_dict(state_dict(tmp_path / "model.pt"), strict=True)
