"""The optimizer's implementation: a torch optimizer with a fused one gets it unless the recipe says
otherwise (as HF Trainer's adamw_torch_fused), the same under every strategy, and a resumed run steps as
its checkpoint's did; TF32 as the recipe says."""

import pytest
import torch

from launcher.build import optimizer
from tests.conftest import train

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
    from launcher.precision import tf32

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
    from launcher.build import _fused_kernel_shards

    assert _fused_kernel_shards(torch.optim.Adam) and _fused_kernel_shards(torch.optim.AdamW)
    assert not _fused_kernel_shards(torch.optim.SGD) and not _fused_kernel_shards(torch.optim.Adagrad)
