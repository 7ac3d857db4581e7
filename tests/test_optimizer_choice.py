"""The optimizer's implementation: a torch optimizer with a fused one gets it unless the recipe says
otherwise (as HF Trainer's adamw_torch_fused), the same under every strategy, and a resumed run steps as
its checkpoint's did where the new layout can (every layout's checkpoints resume under every other); TF32 as
the recipe says."""

import pytest
import torch

from launcher.run.build import optimizer
from tests.conftest import QUICKSTART, SMALL, train

PARAMS = lambda: [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]  # noqa: E731


@pytest.mark.parametrize("target", ["torch.optim.AdamW", "torch.optim.Adam", "torch.optim.SGD", "torch.optim.Adagrad"])
def test_a_torch_optimizer_with_a_fused_implementation_gets_it(target):
    built, said = optimizer({"_target_": target, "lr": 0.1}, PARAMS())
    assert built.param_groups[0]["fused"] is True
    assert said == (f"optimizer: {target} with fused=True, torch's fastest implementation on cpu "
                    f"(optimizer.fused=false keeps torch's default)")


@pytest.mark.parametrize("spec", [
    {"_target_": "torch.optim.AdamW", "fused": False},  # the recipe's word: torch's default
    {"_target_": "torch.optim.AdamW", "foreach": True},
    {"_target_": "torch.optim.AdamW", "differentiable": True},  # fused cannot
    {"_target_": "torch.optim.RMSprop"},  # no fused implementation: torch's default
    {"_target_": "torch.optim.LBFGS"},
])
def test_what_the_recipe_says_or_the_optimizer_lacks_is_left_as_it_is(spec):
    built, said = optimizer(spec, PARAMS())
    assert said is None and not built.param_groups[0].get("fused")


def test_parameters_fused_kernels_cannot_take_keep_torch_s_default():
    built, said = optimizer({"_target_": "torch.optim.SGD", "lr": 0.1}, [torch.nn.Parameter(torch.ones(2, dtype=torch.float64)),
                                                                       torch.nn.Parameter(torch.ones(2).to(torch.bfloat16))])
    assert said is not None  # float64 and bf16 are floating point: fused takes them on the CPU
    ints = torch.nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)
    built, said = optimizer({"_target_": "torch.optim.SGD", "lr": 0.1}, [ints])
    assert said is None and not built.param_groups[0].get("fused")


def test_a_run_says_its_choice_and_a_resumed_run_steps_as_its_checkpoint_did(tmp_path, capsys):
    train(tmp_path / "a", "trainer.max_steps=20", "checkpoint.every=10", "optimizer.fused=false")
    assert "with fused=True" not in capsys.readouterr().out
    train(tmp_path / "a", "trainer.max_steps=30", "checkpoint.every=10")  # resumed at 20: its optimizer's groups
    assert "optimizer: resumed with its checkpoint's implementation (fused=False)" in capsys.readouterr().out
    state = torch.load(tmp_path / "a" / "checkpoints" / "step_30" / "state.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["fused"] is False
    train(tmp_path / "b", "trainer.max_steps=10")
    assert "optimizer: torch.optim.AdamW with fused=True" in capsys.readouterr().out


def test_tf32_is_the_recipe_s_word_on_cuda_and_torch_s_default_without_one():
    from launcher.model.precision import tf32

    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        tf32(None, torch.device("cuda"))
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags
        tf32(True, torch.device("cpu"))  # nothing on the CPU
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags
        for allowed in (True, False):
            tf32(allowed, torch.device("cuda"))
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (allowed, allowed)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_fsdp_s_sharded_parameters_get_fused_only_where_dtensor_can_run_its_kernel():
    """torch 2.13's DTensor has sharding rules for fused Adam and AdamW, not SGD or Adagrad, whose first
    step under fsdp failed ('aten._fused_sgd_.default does not have a sharding strategy registered'):
    those keep torch's default there (tests/test_hf_folders.py trains SGD under fsdp x2)."""
    from launcher.run.build import _fused_kernel_shards

    assert _fused_kernel_shards(torch.optim.Adam) and _fused_kernel_shards(torch.optim.AdamW)
    assert not _fused_kernel_shards(torch.optim.SGD) and not _fused_kernel_shards(torch.optim.Adagrad)


def test_fused_true_on_parameters_dtensor_cannot_step_fused_is_one_line(tmp_path, one_rank):
    """fsdp in a world of one (this process): its shards are DTensors, as at any world size."""
    from launcher.errors import UserError

    with pytest.raises(UserError) as caught:
        train(tmp_path, "strategy=fsdp", "devices=cpu", "optimizer={_target_: torch.optim.SGD, lr: 0.1, fused: true}")
    assert caught.value.problems == [
        "optimizer.fused: true, and torch.optim.SGD's fused kernel cannot step this layout's sharded parameters "
        f"(torch {torch.__version__.split('+')[0]}'s DTensor has no rule for it); set optimizer.fused=false, or leave "
        "it out and the launcher picks"]


def test_a_resumed_implementation_gets_the_grad_scaler_s_hand_off_it_takes():
    """A fused optimizer takes fp16's scale from GradScaler inside its step; torch's loop over the tensors asserts it
    gets none. A fused=False checkpoint resumed by an optimizer built fused steps unfused: GradScaler must unscale."""
    from launcher.run.build import implementation_resumed

    params = PARAMS()
    built, _ = optimizer({"_target_": "torch.optim.SGD", "lr": 0.1}, params)
    built.load_state_dict(torch.optim.SGD(params, lr=0.1, fused=False).state_dict())
    assert implementation_resumed(built).startswith("optimizer: resumed with its checkpoint's implementation (fused=False)")
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(sum(q.sum() for q in params)).backward()
    scaler.step(built)  # AssertionError: Expected grad_scale and found_inf to be None, before
    scaler.update()


# Each optimizer the launcher makes fused whose fused kernel torch 2.13's DTensor has no rule for (Adam's and AdamW's
# have one: the charlm tests of tests/test_parallel.py resume AdamW from one process under dp_shard 2 x tp 2).
FUSED_WITHOUT_RULE = {"SGD": "{_target_: torch.optim.SGD, lr: 0.1, momentum: 0.9}",
                      "Adagrad": "{_target_: torch.optim.Adagrad, lr: 0.1}"}
LAYOUTS = {"fsdp": ["strategy=fsdp", "devices=cpu"],
           "tp": ["strategy=fsdp", "devices=cpu", "parallel.tp=2", "parallel.tp_plan={'0': colwise, '2': rowwise}"]}
RESUMED = ["trainer.max_steps=20", "checkpoint.every=10"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Each of FUSED_WITHOUT_RULE trained in one process (fused; and in float64, where no kernel is fused: the exact
    run float32's rounding is measured against), and its step 10 resumed under each of LAYOUTS on two ranks: the four
    resumes in one torchrun launch (tests/several_runs.py)."""
    from tests.rounding import float64
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("layouts")
    cases = {}
    for name, spec in FUSED_WITHOUT_RULE.items():
        train(root / name, f"optimizer={spec}", *RESUMED)
        train(root / f"{name}-exact", f"optimizer={spec}", *RESUMED, *float64("recipes.components.mlp.MLP"))
        for layout, args in LAYOUTS.items():
            cases[f"{name}-{layout}"] = [QUICKSTART, *SMALL, f"optimizer={spec}", *RESUMED, *args,
                                         f"run_dir={root / f'{name}-{layout}'}",
                                         f"checkpoint.resume={root / name / 'checkpoints' / 'step_10'}"]
    return root, several(cases, root)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FUSED_WITHOUT_RULE)
def test_a_fused_one_process_checkpoint_resumes_under_fsdp_and_tp_as_one_process_ends(resumed, name, layout):
    """Before: 'aten._fused_sgd_.default does not have a sharding strategy registered' on every rank at the first
    step. Now the run goes on with torch's default, says so, and ends as the uninterrupted run does, within float32's
    rounding (the fused kernels run only in float32: tests/rounding.py)."""
    from tests.rounding import assert_within_float32_rounding

    root, ranks = resumed
    for results in ranks:
        assert results[f"{name}-{layout}"]["error"] is None, results[f"{name}-{layout}"]["error"]
    said = ranks[0][f"{name}-{layout}"]["said"]
    assert "written by 1 process, resharded to 2" in said
    assert (f"optimizer: its checkpoint stepped with fused=True, which {name} cannot on this layout's sharded "
            f"parameters (torch's DTensor has no rule for its fused kernel); it goes on with torch's default "
            f"(fused=False), as a fresh run here does, which rounds apart in the last bits") in said
    assert_within_float32_rounding(root / name / "model.pt", root / f"{name}-{layout}" / "model.pt",
                                   root / f"{name}-exact" / "model.pt")
