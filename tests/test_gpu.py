"""Checks that need CUDA. Skipped, saying why, on a machine without a GPU: `python -m pytest -m gpu`."""

import sys

import pytest
import torch

import launcher.run.loop
import launcher.run.train  # before any patching: its `from launcher.run.loop import fit` must bind the real fit
from launcher.run.metrics import TrainMeter
from recipes.components.mlp import MLP
from tests.conftest import state_dict, train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]


def allowing_syncs(fn):
    """Run `fn` with CUDA sync checks off: it is a log step, an evaluation or a checkpoint."""
    def wrapped(*args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()  # a save after fit() returns runs with checks already off
        torch.cuda.set_sync_debug_mode(0)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    return wrapped


@pytest.fixture(autouse=True)
def sync_checks_off_after():
    """No test leaves CUDA's sync checks on for the next."""
    yield
    torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_host_sync_between_log_steps(tmp_path, monkeypatch, request, precision, strategy):
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronising call between two log steps
    (fsdp: in this process, as a torchrun world of one on nccl)."""
    if strategy == "fsdp":
        request.getfixturevalue("one_rank")
    fit = launcher.run.loop.fit

    def strict_fit(parts, *args):
        parts.save = allowing_syncs(parts.save)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fit(parts, *args)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(launcher.run.loop, "fit", strict_fit)
    monkeypatch.setattr(launcher.run.train, "fit", strict_fit)
    monkeypatch.setattr(TrainMeter, "read", allowing_syncs(TrainMeter.read))
    monkeypatch.setattr(launcher.run.loop, "evaluate", allowing_syncs(launcher.run.loop.evaluate))
    values = train(tmp_path, "devices=cuda", f"strategy={strategy}", f"precision={precision}", "trainer.grad_accum_steps=2",
                   "trainer.clip_grad_norm=1.0", "trainer.eval_every=40", "checkpoint.every=30",
                   "lr_schedule={_target_: torch.optim.lr_scheduler.CosineAnnealingLR, T_max: 80}")
    assert values["val/accuracy"] > 0.5


def test_fp16_with_grad_scaler(tmp_path):
    values = train(tmp_path, "devices=cuda", "precision=fp16")
    assert 0 < values["train/loss"] < 2.3
    assert "scale" in torch.load(tmp_path / "checkpoints/step_80/state.pt", weights_only=True)["scaler"]


def test_checkpoint_saved_on_gpu_loads_on_cpu(tmp_path):
    train(tmp_path, "devices=cuda", "checkpoint.every=40")
    MLP().load_state_dict(state_dict(tmp_path / "model.pt"), strict=True)
    state = torch.load(tmp_path / "checkpoints/step_80/state.pt", map_location="cpu", weights_only=True)
    assert state["rng"][0]["cuda"].device.type == "cpu"


def test_resume_on_gpu(tmp_path):
    train(tmp_path / "a", "devices=cuda")
    train(tmp_path / "b", "devices=cuda", "trainer.max_steps=45", "checkpoint.every=45")
    train(tmp_path / "b", "devices=cuda")
    a, b = state_dict(tmp_path / "a/model.pt"), state_dict(tmp_path / "b/model.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key])


def test_dp_on_cuda(tmp_path):
    from tests.test_strategies import RECIPE, run

    done = run([sys.executable, "-m", "launcher", *RECIPE, f"run_dir={tmp_path}", "strategy=dp", "devices=cuda"])
    assert "(dp)" in done.stdout and "cuda:0" in done.stdout
    MLP().load_state_dict(state_dict(tmp_path / "model.pt"), strict=True)


def test_ddp_nccl_one_process(tmp_path):
    from tests.test_strategies import RECIPE, TORCHRUN, run

    done = run([*TORCHRUN, "--standalone", "--nproc_per_node=1", "-m", "launcher", *RECIPE,
                f"run_dir={tmp_path}", "strategy=ddp", "devices=cuda"])
    assert "(ddp)" in done.stdout and "cuda:0" in done.stdout
    MLP().load_state_dict(state_dict(tmp_path / "model.pt"), strict=True)


def test_fsdp_nccl_charlm_bf16(tmp_path):
    """charlm's Blocks sharded on nccl (one process), in bf16, with activation checkpointing; model.pt loads
    into the plain model; the sharded checkpoint resumes under ddp."""
    from recipes.components.gpt import GPT
    from tests.test_strategies import TORCHRUN, run

    small = ["recipes/charlm.yaml", "devices=cuda", "model.n_layer=2", "model.n_embd=128", "model.n_head=4",
             "trainer.max_steps=40", "checkpoint.every=20", "logging.tensorboard=false"]
    done = run([*TORCHRUN, "--standalone", "--nproc_per_node=1", "-m", "launcher", *small, f"run_dir={tmp_path / 'a'}",
                "strategy=fsdp", "trainer.activation_checkpointing=[Block]"], timeout=600)
    assert "(fsdp)" in done.stdout and "units Block" in done.stdout
    GPT(vocab_size=65, block_size=256, n_layer=2, n_head=4, n_embd=128, bias=False).load_state_dict(
        state_dict(tmp_path / "a" / "model.pt"), strict=True)
    run([*TORCHRUN, "--standalone", "--nproc_per_node=1", "-m", "launcher", *small, f"run_dir={tmp_path / 'b'}",
         "strategy=ddp", f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / 'step_20'}"], timeout=600)


def test_fsdp_background_saves_on_gpu_stage_pinned_and_resume_bitwise(tmp_path):
    """fsdp's async saves on a GPU stage through DCP's page-locked stager: the checkpoint a background save
    wrote at step 10 resumes to the same model.pt, bitwise, as the run that went on from it."""
    from tests.test_strategies import TORCHRUN, run

    small = ["recipes/charlm.yaml", "devices=cuda", "model.n_layer=2", "model.n_embd=128", "model.n_head=4",
             "model.dropout=0.0", "data.val=null", "trainer.max_steps=20", "checkpoint.every=10",
             "checkpoint.async_save=true", "logging.tensorboard=false", "strategy=fsdp"]
    for name, extra in (("a", []), ("b", [f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / 'step_10'}"])):
        run([*TORCHRUN, "--standalone", "--nproc_per_node=1", "-m", "launcher", *small, *extra,
             f"run_dir={tmp_path / name}"], timeout=600)
    a, b = state_dict(tmp_path / "a" / "model.pt"), state_dict(tmp_path / "b" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 matmuls need compute capability 8.9 or newer (H100, L4, RTX 4090)")
def test_fp8_trains_charlm_under_fsdp_and_its_model_loads_plain(tmp_path):
    """precision fp8: Float8Linear layers (their keys the plain model's), FSDP gathering them in fp8, compiled;
    the loss falls as bf16's does, within 5% of it after 200 steps, and model.pt loads into the plain GPT."""
    pytest.importorskip("torchao", reason="the fp8 extra (torchao) is not installed")
    from recipes.components.gpt import GPT
    from tests.test_strategies import TORCHRUN, run

    small = ["recipes/charlm.yaml", "devices=cuda", "model.n_layer=2", "model.n_embd=256", "model.n_head=4",
             "model.dropout=0.0", "trainer.max_steps=200", "trainer.compile=true", "checkpoint.every=null",
             "logging.tensorboard=false", "data.val=null", "strategy=fsdp"]
    losses = {}
    for precision in ("bf16", "fp8"):
        done = run([*TORCHRUN, "--standalone", "--nproc_per_node=1", "-m", "launcher", *small,
                    f"precision={precision}", f"run_dir={tmp_path / precision}"], timeout=600)
        losses[precision] = float(done.stdout.split("train/loss ")[-1].split()[0])
    assert "precision: fp8: 8 Linear layers multiply in fp8" in done.stdout, done.stdout
    assert abs(losses["fp8"] / losses["bf16"] - 1) < 0.05, losses
    GPT(vocab_size=65, block_size=256, n_layer=2, n_head=4, n_embd=256, bias=False).load_state_dict(
        state_dict(tmp_path / "fp8" / "model.pt"), strict=True)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 matmuls need compute capability 8.9 or newer (H100, L4, RTX 4090)")
def test_fp8_scales_computed_after_the_step_are_the_stepped_weights_own(one_rank):
    """Under FSDP2 the fp8 weights' scales are computed once after each optimizer step (float8_scales_ahead):
    each is fp8's largest value over the amax of the weight as it stepped, not of the weight before."""
    pytest.importorskip("torchao", reason="the fp8 extra (torchao) is not installed")
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8.float8_utils import EPS

    from launcher.model.precision import Precision, float8_scales_ahead, to_float8

    dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).cuda()
        assert to_float8(model, sharded=True) == 2
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        precision = Precision("fp8", torch.device("cuda:0"))
        precision.after_step = float8_scales_ahead(model)
        for _ in range(2):
            before = [layer.weight.full_tensor().detach().clone() for layer in (model[0], model[2])]
            with precision.autocast():
                loss = model(torch.randn(32, 64, device="cuda")).float().square().mean()
            loss.backward()
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            for layer, old in zip((model[0], model[2]), before):
                weight = layer.weight.full_tensor().detach()
                assert not torch.equal(weight, old)  # it stepped
                amax = weight.abs().max().clamp(min=EPS).double()
                expected = (torch.finfo(torch.float8_e4m3fn).max / amax).float()
                assert torch.equal(layer.weight._local_tensor._precomputed_scale, expected)
    finally:
        dist.destroy_process_group()


def test_fsdp_cpu_offload_trains_and_resumes(tmp_path, one_rank):
    values = train(tmp_path, "devices=cuda", "strategy=fsdp", "fsdp.cpu_offload=true", "trainer.grad_accum_steps=2",
                   "trainer.clip_grad_norm=1.0", "checkpoint.every=40")
    assert 0 < values["train/loss"] < 2.3
    MLP().load_state_dict(state_dict(tmp_path / "model.pt"), strict=True)


def test_batches_copied_ahead_on_a_side_stream_are_the_host_batches():
    from launcher.data import sampling as data
    from recipes.components.synthetic import Blobs

    dataset = Blobs(n=200)

    def batches(device):
        train = data.TrainData(dataset, 32, 1, 1, 0, True, 0, 0, torch.device(device))
        position = data.Position(epoch=0, batch=2)
        stream = train.stream(position)
        out = []
        for _ in range(3 * train.batches_per_epoch):
            x, y = next(stream)
            out.append((x.cpu(), y.cpu(), position.epoch, position.batch))
        return out

    on_cpu, on_gpu = batches("cpu"), batches("cuda")
    assert len(on_gpu) == len(on_cpu)
    for (a, b, e, n), (c, d, f, m) in zip(on_cpu, on_gpu):
        assert torch.equal(a, c) and torch.equal(b, d) and (e, n) == (f, m)


def test_a_cuda_out_of_memory_names_the_step_and_the_peak_and_dumps_a_snapshot(tmp_path):
    from tests.conftest import launch

    done = launch("recipes/quickstart.yaml", f"run_dir={tmp_path}", "devices=cuda", "trainer.max_steps=20",
                  "checkpoint.every=5", "memory_snapshot.at_step=6", "memory_snapshot.steps=100",
                  "model={_target_: tests.components.OutOfMemoryAt, at: 8, in_dim: 32, hidden: 128, classes: 10}")
    assert done.returncode == 5, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("launcher: out of memory in step 8 on cuda:0 (peak "), line
    assert "GiB of " in line and "; memory snapshot: " in line
    snapshot = line.split("; memory snapshot: ")[1].split(". HINT")[0]
    import pickle

    with open(snapshot, "rb") as f:
        assert "segments" in pickle.load(f)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_5"


def test_a_cuda_profile_window_holds_kernels_and_a_snapshot_window_a_pickle(tmp_path):
    import json
    import pickle

    train(tmp_path, "devices=cuda", "profile.at_step=3", "profile.steps=2", "memory_snapshot.at_step=3",
          "memory_snapshot.steps=2")
    (trace,) = (tmp_path / "profile").iterdir()
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA kernels, not only host ops
    (snapshot,) = (tmp_path / "memory").iterdir()
    assert snapshot.name == "rank0_step3-4.pickle"
    with open(snapshot, "rb") as f:
        assert pickle.load(f)["segments"]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_fused_optimizer_is_chosen_on_cuda_and_trains(tmp_path, capsys, precision):
    """The default implementation on a GPU: fused, with the fp16 grad scaler too (fused optimizers take its
    scale and its inf check on the device); tf32 as the recipe says."""
    values = train(tmp_path, "devices=cuda", f"precision={precision}", "tf32=true", "trainer.max_steps=40")
    assert "optimizer: torch.optim.AdamW with fused=True, torch's fastest implementation on cuda" in capsys.readouterr().out
    assert values["train/loss"] < 2.3 and torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False


def test_the_expert_load_is_counted_and_kept_without_a_host_sync():
    """An MoE model's counting hook, the meter's mark and rollback of it, and its reset, under
    torch.cuda.set_sync_debug_mode("error") (index_add_ on the device: torch.bincount would read its input's
    largest value on the host). Called on the experts module's inputs alone: the model's own experts code is
    transformers'."""
    pytest.importorskip("transformers")
    from launcher.model import moe
    from tests import moe_zoo

    model = moe_zoo.model("qwen3_moe").cuda()
    load = moe.ExpertLoad(model, torch.device("cuda"))
    name, experts = moe.experts_of(model)[0]
    hidden = torch.randn(64, 32, device="cuda")
    index = torch.randint(0, 8, (64, 2), device="cuda")
    weights = torch.rand(64, 2, device="cuda")
    hook = next(iter(experts._forward_pre_hooks.values()))
    torch.cuda.set_sync_debug_mode("error")
    mark = load.mark()
    hook(experts, (hidden, index, weights), {})
    load.back_to(mark)
    hook(experts, (hidden, index, weights), {})
    packed = load.packed()
    torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(load.counts[0, :8].cpu(), torch.bincount(index.reshape(-1).cpu(), minlength=8))
    assert packed.sum().item() == 128
