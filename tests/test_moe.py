"""Mixture-of-experts models as transformers publishes them (Qwen3-MoE, Mixtral, gpt-oss, a DeepSeek-V3-style
config with shared experts and grouped routing: tests/moe_zoo.py).

- Built from their configs through a recipe, they train under ddp x2 and under fsdp x2 (its units the decoder
  layers, recomputing their activations) to one process's weights, in float64 (tests/rounding.py).
- A folder save_pretrained wrote (each expert's own matrices) initialises the model whole, and under fsdp into
  the shards of a model built on the meta device, each rank reading its experts; export writes the model back
  as save_pretrained would, and from_pretrained gives the trained logits.
- The start line names the experts and whether the router's load-balancing loss is trained; it is, in train/loss.
- LoRA (peft) adapts the experts' own 3-D weights where its target_parameters name them, from a published folder,
  under one process and fsdp x2 alike; export writes the adapters as peft does, and refuses to merge them.
- Each MoE layer's expert load is logged (metrics.jsonl): its shares bounded as top k allows, a router forced to
  two experts giving them 1.0, the same under ddp and fsdp as in one process (the counts summed over the ranks),
  counted once per routed token (not again when a layer is recomputed, not in evaluation), read on the host
  at log steps only.

The runs of two processes share one torchrun launch (tests/several_runs.py)."""

import json
import sys

import pytest
import torch
import yaml

from tests.conftest import REPO, state_dict
from tests.rounding import assert_within_rounding, float64

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
from tests import moe_zoo  # noqa: E402  (transformers first)

FAMILIES = list(moe_zoo.FAMILIES)
STEPS = 4
# rows of 12 to 24 tokens: one process pads the batch to its longest row, each of two ranks its half to the half's
# longest; the padding is routed too, and the expert load, which leaves it out, is still the same on every layout
DATA = {"_target_": "recipes.components.passages.Passages", "n": 256, "min_len": 12, "max_len": 24, "prompt": 4}
FINETUNE = REPO / "recipes" / "hf_finetune.yaml"
LORA = REPO / "recipes" / "hf_lora.yaml"
EXPERTS_LORA = "model.peft_config.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"
SHORT = ["on_cpu=null", "precision=fp32", f"trainer.max_steps={STEPS}", "trainer.log_every=2",
         "trainer.eval_every=null", "checkpoint.every=null", "logging.tensorboard=false", "logging.progress_bar=false", "data.val=null",
         "trainer.activation_checkpointing=null", "data.batch_size=8", "logging.memory_plan=false",
         "optimizer={_target_: torch.optim.SGD, lr: 0.5}"]


def recipe(path, family: str, run_dir, model: dict = None, **keys) -> str:
    """A recipe that trains the family's model from its config (the load-balancing loss off unless `keys` say)."""
    section = model or moe_zoo.model_section(family, **{"output_router_logits": False, **keys})
    path.write_text(yaml.safe_dump({
        "name": family, "run_dir": str(run_dir), "model": section,
        "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.5},
        "data": {"train": DATA, "collate": {"_target_": "launcher.data.collate.Pad", "values": {"labels": -100}},
                 "batch_size": 8},
        "trainer": {"max_steps": STEPS, "log_every": 1}, "checkpoint": {"every": None},
        "logging": {"tensorboard": False, "progress_bar": False, "memory_plan": False, "jsonl": True}}))
    return str(path)


def exact(family: str) -> list:
    return float64(f"transformers.{moe_zoo.FAMILIES[family][0]}")


def here(recipe_path, *overrides):
    from launcher.recipe import load
    from launcher.run.train import train

    return train(load(recipe_path, list(overrides)))


def logged(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def loads(run_dir) -> list:
    return [{k: v for k, v in row.items() if k.startswith("moe/")} for row in logged(run_dir) if "train/loss" in row]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Every family from its config under ddp x2 and under fsdp x2 (recomputing its decoder layers), and from a
    published folder under fsdp x2 (built on the meta device): one torchrun launch. (folder, rank 0's results)."""
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("moe")
    cases = {}
    for family in FAMILIES:
        path = recipe(root / f"{family}.yaml", family, root / family)
        cases[f"{family}-ddp"] = [path, f"run_dir={root / family}-ddp", "strategy=ddp", *exact(family)]
        cases[f"{family}-fsdp"] = [path, f"run_dir={root / family}-fsdp", "strategy=fsdp",
                                   "trainer.activation_checkpointing=auto", *exact(family)]
        base = moe_zoo.folder(root / f"{family}-published", family)
        cases[f"{family}-folder"] = [str(FINETUNE), f"model.config.pretrained_model_name_or_path={base}",
                                     f"run_dir={root / family}-folder", *SHORT, "strategy=fsdp",
                                     "trainer.activation_checkpointing=auto", *float64(
                                         "transformers.AutoModelForCausalLM.from_config")]
    cases["qwen3_moe-pp"] = [recipe(root / "pp.yaml", "qwen3_moe", root / "pp"), "strategy=fsdp", "parallel.pp=2"]
    base = root / "qwen3_moe-published"
    cases["lora-fsdp"] = [str(LORA), *lora(base, root / "lora-fsdp", "strategy=fsdp", *float64("peft.get_peft_model"))]
    return root, several(cases, root, timeout=900)[0]


def lora(base, run_dir, *extra) -> list:
    """hf_lora.yaml's overrides: LoRA on the attention's q_proj and v_proj and on the experts' weights of `base`."""
    return [f"model.model.config.pretrained_model_name_or_path={base}", f"run_dir={run_dir}",
            *[o for o in SHORT if not o.startswith("trainer.activation")], EXPERTS_LORA, *extra]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_to_one_process_weights_under_ddp_and_fsdp(family, tmp_path, two_processes):
    root, results = two_processes
    here(recipe(tmp_path / "one.yaml", family, tmp_path / "one"), *exact(family))
    layer = moe_zoo.FAMILIES[family][0].replace("ForCausalLM", "DecoderLayer")
    for strategy in ("ddp", "fsdp"):
        done = results[f"{family}-{strategy}"]
        assert done["error"] is None, done
        assert_within_rounding(tmp_path / "one" / "model.pt", root / f"{family}-{strategy}" / "model.pt", steps=STEPS)
    said = results[f"{family}-fsdp"]["said"]
    assert f"fsdp: sharded over 2 ranks; units {layer}" in said and f"modules ({layer}) recompute" in said, said
    # the expert load is the whole batch's on every layout: the counts are summed over the ranks
    one = loads(tmp_path / "one")
    assert len(one) == STEPS and all(one), one
    for strategy in ("ddp", "fsdp"):
        two = loads(root / f"{family}-{strategy}")
        assert [r.keys() for r in two] == [r.keys() for r in one]
        assert all(abs(a[k] - b[k]) < 1e-12 for a, b in zip(one, two) for k in a), (strategy, one, two)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_published_folder_loads_into_shards_and_trains_as_one_process(family, tmp_path, two_processes):
    """Under fsdp each rank reads its own experts' matrices (of 4 or 8, 2 or 4 a rank) into a model built on the
    meta device."""
    root, results = two_processes
    done = results[f"{family}-folder"]
    assert done["error"] is None, done
    base = root / f"{family}-published"
    assert f"initialised the model from {base} into this rank's shards" in done["said"], done["said"]
    from launcher.recipe import load
    from launcher.run.train import train

    train(load(FINETUNE, [f"model.config.pretrained_model_name_or_path={base}", f"run_dir={tmp_path / 'one'}",
                          *SHORT, *float64("transformers.AutoModelForCausalLM.from_config")]))
    assert_within_rounding(tmp_path / "one" / "model.pt", root / f"{family}-folder" / "model.pt", steps=STEPS)


@pytest.mark.slow
def test_lora_on_the_experts_weights_under_fsdp_ends_as_one_process(tmp_path, two_processes):
    root, results = two_processes
    done = results["lora-fsdp"]
    assert done["error"] is None, done
    assert "LoRA adapts the experts' weights (peft's target_parameters)" in done["said"], done["said"]
    here(LORA, *lora(root / "qwen3_moe-published", tmp_path / "one", *float64("peft.get_peft_model")))
    assert_within_rounding(tmp_path / "one" / "model.pt", root / "lora-fsdp" / "model.pt", steps=STEPS)


def test_lora_on_the_experts_weights_trains_from_a_published_folder_and_exports_as_peft_does(tmp_path, capsys):
    import peft

    from tests.test_hf_folders import export

    base = moe_zoo.folder(tmp_path / "base", "qwen3_moe")
    here(LORA, *lora(base, tmp_path / "run"))
    said = capsys.readouterr().out
    assert "(the base model's weights; its 16 adapter tensors as built)" in said, said  # q, v, 2 experts: A, B
    assert "LoRA adapts the experts' weights (peft's target_parameters)" in said, said
    got = state_dict(tmp_path / "run" / "model.pt")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()
    fused = "base_model.model.model.layers.1.mlp.experts.base_layer.base_layer.gate_up_proj"
    assert torch.equal(got[fused], loaded["model.layers.1.mlp.experts.gate_up_proj"])  # frozen, joined from the folder
    experts_b = [k for k in got if ".mlp.experts." in k and ".lora_B." in k]
    assert len(experts_b) == 4 and all(got[k].abs().sum() > 0 for k in experts_b)  # built as zeros, trained
    done = export(tmp_path / "run", tmp_path / "adapters", "--format", "peft")
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    trained = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(
        **{k: config[k] for k in ("r", "lora_alpha", "target_modules", "target_parameters", "task_type")}))
    trained.load_state_dict(got)
    read = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base),
                                          tmp_path / "adapters")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(read(ids).logits, trained(ids).logits, rtol=0, atol=1e-6)
    done = export(tmp_path / "run", tmp_path / "merged", "--format", "hf", "--merge-lora")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "the adapters include LoRA on parameters (mlp.experts.down_proj, mlp.experts.gate_up_proj" in done.stderr
    from launcher.errors import UserError

    with pytest.raises(UserError, match="checkpoint.export_hf: merges the adapters into the HF folder, and the adapters "
                                        "include LoRA on parameters"):  # said at start, not after training
        here(LORA, *lora(base, tmp_path / "to-hf", "checkpoint.export_hf=true"))
    assert not (tmp_path / "to-hf" / "model.pt").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_published_folder_in_and_the_same_layout_out(family, tmp_path):
    """One process: the folder's per-expert matrices make the model's fused experts (the weights are those
    from_pretrained loads); export --format hf writes the trained model as save_pretrained would (the same
    tensor names), and from_pretrained of it gives the trained model's logits."""
    from launcher.recipe import load
    from launcher.run.train import train
    from tests.test_hf_folders import assert_the_trained_logits, export

    base = moe_zoo.folder(tmp_path / "base", family)
    train(load(FINETUNE, [f"model.config.pretrained_model_name_or_path={base}", f"run_dir={tmp_path / 'start'}",
                          *SHORT, "trainer.max_steps=1", "optimizer.lr=0.0"]))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()
    got = state_dict(tmp_path / "start" / "model.pt")
    assert got.keys() == loaded.keys() and all(torch.equal(got[k], loaded[k]) for k in loaded)
    train(load(FINETUNE, [f"model.config.pretrained_model_name_or_path={base}", f"run_dir={tmp_path / 'run'}", *SHORT]))
    done = export(tmp_path / "run", tmp_path / "out", "--format", "hf", "--max-shard-size", "60KB")
    assert done.returncode == 0, done.stderr
    names = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    written = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert written.keys() == names.keys()
    assert_the_trained_logits(tmp_path / "out", base, tmp_path / "run")


def test_the_start_line_says_the_experts_and_whether_the_balancing_loss_is_trained(tmp_path, capsys):
    cases = [
        ("qwen3_moe", dict(output_router_logits=True, router_aux_loss_coef=0.01),
         "moe: 2 layers of 8 experts, top 2; the router's load-balancing loss is trained (coef 0.01; in train/loss)"),
        ("mixtral", {}, "moe: 2 layers of 4 experts, top 2; the router's load-balancing loss is not trained "
                        "(output_router_logits false"),
        ("deepseek_v3", {}, "moe: 1 layer of 8 experts, top 2, 1 shared, routed within the best 1 of 2 groups; the "
                            "router's load-balancing loss: none in DeepseekV3ForCausalLM"),
    ]
    for family, keys, line in cases:
        here(recipe(tmp_path / f"{family}.yaml", family, tmp_path / family, **keys), "trainer.max_steps=1")
        assert line in capsys.readouterr().out, family


def test_the_balancing_loss_is_in_the_loss_trained(tmp_path):
    """At the first step (lr 0), the loss with router_aux_loss_coef 1 exceeds the loss with 0 by the load-balancing
    loss, which near an even routing (a new model's) is the top k: 2."""
    losses = {}
    for coef in (0.0, 1.0):
        run = tmp_path / str(coef)
        here(recipe(tmp_path / f"{coef}.yaml", "qwen3_moe", run, output_router_logits=True, router_aux_loss_coef=coef),
             "trainer.max_steps=1", "optimizer.lr=0.0")
        losses[coef] = logged(run)[0]["train/loss"]
    assert 1.95 < losses[1.0] - losses[0.0] < 2.05, losses


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_load_is_logged_per_layer_within_what_top_k_allows(family, tmp_path):
    here(recipe(tmp_path / "r.yaml", family, tmp_path / "run"))
    rows = loads(tmp_path / "run")
    k, experts, layers = 2, moe_zoo.EXPERTS[family], moe_zoo.MOE_LAYERS[family]
    assert len(rows) == STEPS
    for row in rows:
        assert sorted(row) == sorted(["moe/load_max", "moe/load_min", *[f"moe/load_{m}/layer_{i}" for i in layers
                                                                         for m in ("max", "min")]])
        for i in layers:  # shares sum to k: the largest at least k / experts, the smallest at most
            assert k / experts <= row[f"moe/load_max/layer_{i}"] <= 1.0
            assert 0.0 <= row[f"moe/load_min/layer_{i}"] <= k / experts
        for m in ("max", "min"):
            assert abs(row[f"moe/load_{m}"] - sum(row[f"moe/load_{m}/layer_{i}"] for i in layers) / len(layers)) < 1e-12


@pytest.mark.slow
def test_the_load_is_not_logged_under_pipeline_stages(two_processes):
    """Each stage counts its own layers, and the pipeline's reduction keeps its last stage's values: said, not
    logged (before, the first stage's layers were logged as never routed)."""
    root, results = two_processes
    done = results["qwen3_moe-pp"]
    assert done["error"] is None and "moe: the expert load is not logged under parallel.pp" in done["said"], done
    assert all(not row for row in loads(root / "pp"))


def test_a_router_forced_to_two_experts_gives_them_all_the_tokens(tmp_path, capsys):
    here(recipe(tmp_path / "r.yaml", "gpt_oss", tmp_path / "run",
                model={"_target_": "tests.moe_zoo.forced"}))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    # the console shows the means alone
    assert lines and all(line.endswith("| load_max 1.0000 | load_min 0.0000") for line in lines), lines
    for row in loads(tmp_path / "run"):
        assert row["moe/load_max"] == 1.0 and row["moe/load_min"] == 0.0, row
        assert row["moe/load_max/layer_1"] == 1.0 and row["moe/load_min/layer_0"] == 0.0, row


@pytest.mark.parametrize("family", FAMILIES)
def test_each_routed_token_is_counted_once(family):
    """The counts are what the routers chose in the forward (their own output, seen by a hook of the test's),
    once though the layers recompute their activations in backward, and nothing in evaluation."""
    from launcher.model import moe, recompute

    torch.manual_seed(0)
    model = moe_zoo.model(family)
    recompute.apply(model, [moe_zoo.FAMILIES[family][0].replace("ForCausalLM", "DecoderLayer")])
    load = moe.ExpertLoad(model, torch.device("cpu"))
    routers = [getattr(model.model.layers[i].mlp, "gate", None) or model.model.layers[i].mlp.router
               for i in moe_zoo.MOE_LAYERS[family]]
    chosen = []
    hooks = [r.register_forward_hook(lambda module, args, out: chosen.append(out[2])) for r in routers]
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    for hook in hooks:
        hook.remove()
    loss.backward()  # recomputes each decoder layer, its router and experts again
    experts = moe_zoo.EXPERTS[family]
    assert len(chosen) == len(routers)
    for i, index in enumerate(chosen):
        assert torch.equal(load.counts[i, :experts], torch.bincount(index.reshape(-1), minlength=experts)), i
        assert load.counts[i].sum() == ids.numel() * 2
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert load.counts.sum() == ids.numel() * 2 * len(routers)


def test_the_loop_reads_the_load_on_the_host_at_log_steps_only(tmp_path, monkeypatch):
    """The launcher's host reads do not grow with the steps between two log steps, an MoE model's load counted
    (the model's own code is left out: transformers' eager experts loop reads which experts got tokens)."""
    names = ["item", "tolist", "cpu", "numpy", "__bool__", "__format__", "__float__", "__int__", "__index__"]
    calls = []
    launcher = str(REPO / "launcher")

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(launcher):
                calls.append(f"{name} from {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(self, *args, **kwargs)
        return wrapper

    def host_reads(steps: int) -> list:
        calls.clear()
        path = recipe(tmp_path / f"{steps}.yaml", "qwen3_moe", tmp_path / str(steps))
        with monkeypatch.context() as m:
            for name in names:
                m.setattr(torch.Tensor, name, counting(name))
            here(path, f"trainer.max_steps={steps}", f"trainer.log_every={steps}", "trainer.grad_accum_steps=2",
                 "trainer.activation_checkpointing=auto")
        return list(calls)

    short, long = host_reads(3), host_reads(9)
    assert any(c.startswith("tolist from") for c in short)  # the read per interval is seen: the patch works
    assert sorted(short) == sorted(long), f"reads grow with steps: {sorted(long)} vs {sorted(short)}"
    assert loads(tmp_path / "9")[0]["moe/load_max"] > 0


def test_a_published_form_made_by_moving_values_is_refused_in_one_line(monkeypatch):
    """A conversion that transposes the experts (Qwen3-VL-MoE's), even where it keeps their shape, is not mistaken
    for a block of rows: its probe's values come back out of order."""
    from transformers.core_model_loading import Transpose, WeightConverter

    from launcher.checkpoint import hf_layout
    from launcher.errors import UserError

    monkeypatch.setattr(hf_layout, "conversions", lambda model: [WeightConverter(
        "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj", operations=[Transpose(1, 2)])])
    model = moe_zoo.model("qwen3_moe", hidden_size=64, moe_intermediate_size=32)  # [8, 64, 64]: square
    with pytest.raises(UserError, match=r"^model.layers.0.mlp.experts.gate_up_proj: its published form \(model.layers.0."
                                        r"mlp.experts.gate_up_proj\) moves values across its dimensions"):
        hf_layout.pieces(model, {k: v.shape for k, v in model.state_dict().items()})
