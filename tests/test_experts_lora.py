"""LoRA (peft) on a mixture of experts under expert parallelism (parallel.ep, launcher/parallel/experts.py): the tiny
Qwen3-MoE folder `python -m recipes.components.hf_folder DIR --moe` writes, fine-tuned by recipes/hf_lora.yaml under
ep x 2 (two gloo processes, one torchrun launch: tests/several_runs.py) ends with one process's weights (SGD with
momentum, float64, within rounding: tests/rounding.py), with adapters on the attention alone (the experts frozen,
their slices still dispatched to) and with adapters on the experts' own 3-D weights too (peft's target_parameters:
each rank adds its experts' share of the adapters' update to its slice of the base weights)."""

import pytest

from tests.float64 import overrides as float64
from tests.rounding import assert_within_rounding
from tests.test_parallel import alone, ran

STEPS = 4
EXPERTS_LORA = "model.peft_config.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"
SHORT = ["on_cpu=null", "precision=fp32", f"trainer.max_steps={STEPS}", "trainer.log_every=2",
         "trainer.eval_every=null", "checkpoint.every=null", "logging.tensorboard=false",
         "logging.progress_bar=false", "data.val=null", "data.batch_size=8", "logging.memory_plan=false",
         "optimizer={_target_: torch.optim.SGD, lr: 0.5, momentum: 0.9}"]
EP = ["strategy=fsdp", "parallel.ep=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from recipes.components.hf_folder import write

    folder = tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe"
    write(folder, moe=True)
    return folder


def lora(base, *extra) -> list:
    return [f"model.model.config.pretrained_model_name_or_path={base}", *SHORT, *float64("peft.get_peft_model"),
            *extra]


@pytest.fixture(scope="module")
def two(tmp_path_factory, base):
    """ep x 2: LoRA on the attention alone, and on the experts' weights too (and that run resumed from its step 2);
    tp x 2 (no ep), LoRA on the attention."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("eplora")
    cases = {"attention": ["recipes/hf_lora.yaml", *lora(base, *EP)],
             "experts": ["recipes/hf_lora.yaml", *lora(base, *EP, EXPERTS_LORA, "checkpoint.every=2")],
             "experts-resumed": ["recipes/hf_lora.yaml", *lora(base, *EP, EXPERTS_LORA,
                                                            f"checkpoint.resume={root / 'experts' / 'checkpoints' / 'step_2'}")],
             "tp": ["recipes/hf_lora.yaml", *lora(base, "strategy=fsdp", "parallel.tp=2")]}
    return root, several({name: [*args, f"run_dir={root / name}"] for name, args in cases.items()}, root, timeout=900)


@pytest.mark.slow
def test_lora_on_the_attention_under_ep_x2_gives_one_process_weights(base, two, tmp_path):
    folder, said = ran(two, "attention")
    assert "parallel.ep: 2 experts modules split over 2 ranks, 4 experts on each" in said, said
    assert "LoRA adapts its target modules alone, the experts' weights stay frozen" in said, said
    alone(tmp_path, "recipes/hf_lora.yaml", *lora(base))
    assert_within_rounding(tmp_path / "model.pt", folder / "model.pt", STEPS)


@pytest.mark.slow
def test_lora_on_the_experts_weights_under_ep_x2_gives_one_process_weights(base, two, tmp_path):
    from tests.conftest import state_dict

    folder, said = ran(two, "experts")
    assert "parallel.ep: 2 experts modules split over 2 ranks, 4 experts on each" in said, said
    assert "LoRA adapts the experts' weights (peft's target_parameters)" in said, said
    alone(tmp_path, "recipes/hf_lora.yaml", *lora(base, EXPERTS_LORA))
    assert_within_rounding(tmp_path / "model.pt", folder / "model.pt", STEPS)
    got = state_dict(folder / "model.pt")
    experts_b = [k for k in got if ".mlp.experts." in k and ".lora_B." in k]
    assert len(experts_b) == 4 and all(got[k].abs().sum() > 0 for k in experts_b)  # built as zeros, trained


@pytest.mark.slow
def test_lora_on_the_experts_under_ep_x2_resumes_exactly_and_exports_its_adapters_as_peft_does(base, two, tmp_path):
    """The ep run's step 2 resumed under ep x 2 ends with the run's own weights, bit for bit; its adapters exported
    by `--format peft` (each rank's experts' share of the 3-D adapters gathered whole) are what peft loads onto the
    base model, equal to the run's."""
    import peft
    import torch
    import transformers

    from tests.conftest import state_dict
    from tests.test_hf_folders import export

    folder, _ = ran(two, "experts")
    resumed, said = ran(two, "experts-resumed")
    assert f"resumed from {folder / 'checkpoints' / 'step_2'} (step 2, epoch 0)" in said, said
    trained, again = state_dict(folder / "model.pt"), state_dict(resumed / "model.pt")
    assert trained.keys() == again.keys() and all(torch.equal(trained[k], again[k]) for k in trained)
    done = export(folder, tmp_path / "adapters", "--format", "peft")
    assert done.returncode == 0, done.stderr
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64), tmp_path / "adapters")
    loaded = model.state_dict()
    adapters = [k for k in trained if ".lora_" in k]
    assert any(".mlp.experts." in k for k in adapters) and all(k in loaded for k in adapters), adapters
    assert all(torch.equal(loaded[k], trained[k]) for k in adapters)


@pytest.mark.slow
def test_lora_under_tp_x2_leaves_the_frozen_per_head_norms_frozen(base, two, tmp_path):
    """Before: tp's heads_norm (torch's SequenceParallel) made Qwen3's q_norm and k_norm trainable again, and they
    trained, where one process's peft model keeps them frozen."""
    folder, said = ran(two, "tp")
    assert "fsdp: dp_shard 1 x tp 2 = 2 ranks" in said, said
    alone(tmp_path, "recipes/hf_lora.yaml", *lora(base))
    assert_within_rounding(tmp_path / "model.pt", folder / "model.pt", STEPS)


@pytest.fixture(scope="module")
def with_tp(tmp_path_factory, base):
    """Four processes: ep 2 with tp 2 by the model's own plan, LoRA on the experts' weights too."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("eplora-tp")
    cases = {"ep-tp": ["recipes/hf_lora.yaml", *lora(base, *EP, "parallel.tp=2", EXPERTS_LORA)]}
    return root, several({name: [*args, f"run_dir={root / name}"] for name, args in cases.items()}, root, nproc=4,
                         timeout=900)


@pytest.mark.slow
def test_lora_on_the_experts_weights_under_ep_x2_with_tp_x2_gives_one_process_weights(base, with_tp, tmp_path):
    folder, said = ran(with_tp, "ep-tp")
    assert "whole on each of tp's 2 ranks (which route the same tokens)" in said, said
    alone(tmp_path, "recipes/hf_lora.yaml", *lora(base, EXPERTS_LORA))
    assert_within_rounding(tmp_path / "model.pt", folder / "model.pt", STEPS)


def test_the_model_s_own_tp_plan_leaves_out_experts_that_lora_wraps():
    import peft

    from launcher.parallel import plans
    from tests.moe_models import qwen3_moe

    model = peft.get_peft_model(qwen3_moe(), peft.LoraConfig(
        r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    plan = plans.resolve(model, "auto")
    assert not [name for name in plan if "experts" in name], plan
    assert plan["base_model.model.model.layers.*.self_attn.q_proj"] == "colwise"
