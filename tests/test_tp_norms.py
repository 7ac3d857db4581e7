"""Per-head norms a tensor-parallel plan leaves out (launcher/parallel/heads.py): a tiny HF Qwen3 under tp x 2 by a
recipe's plan copied without its q_norm and k_norm trains to one process's weights (float64, tests/rounding.py),
the launcher having added them as heads_norm and said so in its start line; which norms are found, in a table.
Under tp the model's logits are a view, which FSDP2 warns of and the launcher need not (plans.quiet_split_output)."""

import subprocess
import sys

import pytest
import transformers

from launcher.parallel import heads, plans
from tests.conftest import REPO
from tests.float64 import overrides as float64
from tests.hf_zoo import qwen3
from tests.pace import paced
from tests.rounding import assert_within_rounding
from tests.test_parallel import alone, ran
from tests.test_strategies import TORCHRUN

QWEN3 = ["tests/hf_zoo.yaml", "devices=cpu", *float64("tests.hf_zoo.qwen3"),
         "optimizer={_target_: torch.optim.SGD, lr: 0.1, momentum: 0.9}"]
STEPS = 6  # tests/hf_zoo.yaml's
ATTENTION = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
             "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
NORMS = {"model.layers.*.self_attn.q_norm": "heads_norm", "model.layers.*.self_attn.k_norm": "heads_norm"}
# Megatron's pattern for the attention and the MLP, as torchtitan's and HF's plans give it, less q_norm and k_norm
COPIED = ("parallel.tp_plan={" + ", ".join(f"'{name}': {style}" for name, style in ATTENTION.items()) +
          ", 'model.layers.*.mlp.gate_proj': colwise, 'model.layers.*.mlp.up_proj': colwise, "
          "'model.layers.*.mlp.down_proj': rowwise}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process's run (the reference), and tp x 2 by the copied plan in one torchrun launch."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("tp-norms")
    alone(root / "one", *QWEN3)
    return root, several({"tp": [*QWEN3, "strategy=fsdp", "parallel.tp=2", COPIED, f"run_dir={root / 'tp'}"]}, root,
                         timeout=900)


@pytest.mark.slow
def test_a_plan_without_qwen3_s_per_head_norms_trains_to_one_process_s_weights_and_says_so(runs):
    folder, said = ran(runs, "tp")
    line = next(line for line in said.splitlines() if line.startswith("parallel.tp: "))
    assert line.startswith("parallel.tp: 18 layers split over 2 ranks: model.layers.0.self_attn.q_proj (colwise)")
    assert line.endswith("; added to the plan: model.layers.*.self_attn.q_norm: heads_norm, "
                         "model.layers.*.self_attn.k_norm: heads_norm (per-head norms after a colwise split, which "
                         "train as one process's only so; name them in parallel.tp_plan to choose)"), line
    assert_within_rounding(runs[0] / "one" / "model.pt", folder / "model.pt", STEPS)


def glm4_moe() -> transformers.PreTrainedModel:
    config = transformers.Glm4MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2,
                                        first_k_dense_replace=1)
    return transformers.Glm4MoeForCausalLM(config)


@pytest.mark.parametrize("plan, added", [
    (ATTENTION, NORMS),  # copied without them: both added, by the patterns a user would write
    ({**ATTENTION, **NORMS}, {}),  # named: nothing to add
    ({**ATTENTION, "model.layers.*.self_attn.q_norm": "sequence_parallel"},  # named otherwise: the user's choice
     {"model.layers.*.self_attn.k_norm": "heads_norm"}),
    ({"model.layers.*.self_attn.q_proj": "colwise_rep", "model.layers.*.self_attn.k_proj": "colwise_rep"}, {}),
    ({"lm_head": "colwise", "model.layers.*.mlp.gate_proj": "colwise"}, {}),  # no norm beside, or none per head
    ("auto", {}),  # Qwen3's own plan names them
])
def test_the_per_head_norms_a_plan_leaves_out_are_found(plan, added):
    model = qwen3()
    assert heads.left_out(model, plans.resolve(model, plan)) == added


def test_an_hf_plan_without_its_model_s_per_head_norms_gets_them():
    model = glm4_moe()  # transformers' own plan for GLM-4-MoE splits q_proj, k_proj colwise and omits its qk norms
    assert heads.left_out(model, plans.resolve(model, "auto")) == NORMS


def test_a_lora_model_s_per_head_norms_are_found_under_its_wrapper():
    import peft

    model = peft.get_peft_model(qwen3(), peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj"]))
    plan = {f"base_model.model.{name}": style for name, style in ATTENTION.items()}
    assert heads.left_out(model, plan) == {f"base_model.model.{name}": style for name, style in NORMS.items()}


@pytest.mark.slow
def test_tp_s_view_of_the_logits_is_not_warned_about_and_torch_refuses_to_change_it_in_place(tmp_path):
    # the launcher leaves out FSDP2's warning that the root returned a view (plans.quiet_split_output says why)
    done = subprocess.run([sys.executable, "-m", "launcher", "tests/hf_zoo.yaml", "devices=cpu",
                           "model._target_=tests.hf_zoo.qwen3", "strategy=fsdp", "nproc_per_node=2", "parallel.tp=2",
                           "trainer.max_steps=1", f"run_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                          timeout=paced(300))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "parallel.tp: 20 layers split over 2 ranks" in done.stdout and "view tensor" not in done.stderr
    # ... because the view is one torch will not change in place (the silent failure it warns of cannot happen)
    done = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "tests/tp_views.py", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(300))
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text().startswith(
            "view: True; in-place: Output 0 of _ToTorchTensor is a view and is being modified inplace. This view was "
            "created inside a custom Function"), rank
