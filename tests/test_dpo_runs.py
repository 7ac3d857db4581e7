"""recipes/hf_dpo.yaml through whole runs, in float64 (tests/float64.py) on a tiny Llama folder and the shipped
pairs: fsdp x 2 and tp x 2 (torchrun, gloo) end with one process's weights; the reference is computed once and a
run resumed under another layout reads it back; a packed batch of real pairs gives the step (loss and gradients)
that the same pairs padded give; a data set that is not pairs, and pipeline stages, are one line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import REPO
from tests.float64 import overrides as float64
from tests.pace import paced
from tests.rounding import assert_within_rounding

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")
pytestmark = pytest.mark.slow

RECIPE = REPO / "recipes" / "hf_dpo.yaml"
STEPS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from recipes.components.hf_folder import write

    path = tmp_path_factory.mktemp("dpo-folder") / "tiny"
    write(str(path), layers=2, width=32)
    return path


def args(folder, run_dir, *more):
    return [f"model.config.pretrained_model_name_or_path={folder}", f"run_dir={run_dir}", "devices=cpu",
            "precision=fp32", *float64("transformers.AutoModelForCausalLM.from_config"),
            "optimizer={_target_: torch.optim.SGD, lr: 0.5}", f"trainer.max_steps={STEPS}", "trainer.log_every=3",
            "checkpoint.every=3", "checkpoint.keep=5", "data.batch_size=4", "data.train.cache=null",
            "logging.tensorboard=false", "logging.memory_plan=false", "logging.jsonl=true", *more]


def in_process(folder, run_dir, *more):
    from launcher.recipe import load
    from launcher.run.train import train

    train(load(RECIPE, args(folder, run_dir, *more)))


@pytest.fixture(scope="module")
def one_process(folder, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dpo-one") / "run"
    in_process(folder, run_dir)
    return run_dir


PACKED = ["data.train.packing=true", "data.train.max_len=128", "data.batch_size=2"]  # rows of uneven pair counts


@pytest.fixture(scope="module")
def one_process_packed(folder, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dpo-one-packed") / "run"
    in_process(folder, run_dir, *PACKED)
    return run_dir


@pytest.fixture(scope="module")
def two_processes(folder, one_process, tmp_path_factory):
    from tests.several_runs import several

    root = tmp_path_factory.mktemp("dpo-two")
    cases = {"fsdp": [RECIPE, *args(folder, root / "fsdp", "strategy=fsdp")],
             "tp": [RECIPE, *args(folder, root / "tp", "strategy=fsdp", "parallel.tp=2")],
             "fsdp-packed": [RECIPE, *args(folder, root / "fsdp-packed", "strategy=fsdp", *PACKED)],
             "resumed": [RECIPE, *args(folder, root / "resumed", "strategy=fsdp",
                                       f"checkpoint.resume={one_process / 'checkpoints' / 'step_3'}")]}
    return root, several(cases, root)[0]


def weights(run_dir):
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


def test_one_process_computes_the_reference_once_and_logs_trl_s_names(one_process):
    parts = list((one_process / "reference").glob("*/part-*.safetensors"))
    assert len(parts) == 1
    rows = [json.loads(line) for line in (one_process / "metrics.jsonl").read_text().splitlines()]
    last = [row for row in rows if "train/loss" in row][-1]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected"):
        assert torch.isfinite(torch.tensor(last[f"train/{name}"])), name
    assert last["train/rewards/margins"] == pytest.approx(last["train/rewards/chosen"] - last["train/rewards/rejected"])


@pytest.mark.parametrize("case", ["fsdp", "tp"])
def test_two_processes_end_as_one(case, one_process, two_processes):
    root, results = two_processes
    assert results[case]["error"] is None, results[case]
    assert "computed once" in results[case]["said"]
    assert_within_rounding(weights(one_process), weights(root / case), STEPS)


def test_packed_rows_of_uneven_pair_counts_under_fsdp_end_as_one_process(one_process_packed, two_processes):
    root, results = two_processes
    assert results["fsdp-packed"]["error"] is None, results["fsdp-packed"]
    assert_within_rounding(weights(one_process_packed), weights(root / "fsdp-packed"), STEPS)


def test_a_run_resumed_under_fsdp_reads_the_reference_and_ends_as_one_process(one_process, two_processes):
    root, results = two_processes
    said = results["resumed"]["said"]
    assert results["resumed"]["error"] is None, results["resumed"]
    assert "the reference's log-probabilities of" in said and "read from" in said and "computed once" not in said
    assert_within_rounding(weights(one_process), weights(root / "resumed"), STEPS)


def test_packed_pairs_give_the_step_the_padded_pairs_give(folder):
    from launcher.data.collate import Pairs
    from launcher.data.text import TextDataset
    from launcher.preference import DPO
    from tests.float64 import in_float64
    from transformers import AutoModelForCausalLM

    made = dict(tokenizer=str(folder), files=str(REPO / "recipes" / "data" / "pairs.jsonl"), format="preference",
                max_len=128, cache=None)
    packed, padded = TextDataset(**made, packing=True), TextDataset(**made)
    g = torch.Generator().manual_seed(0)
    values = []
    for k in range(padded.pairs()):
        item = padded.pair_item(k)
        values.append(tuple(torch.randn(len(item[f"{side}_labels"]), generator=g, dtype=torch.float64)
                            .masked_fill(item[f"{side}_labels"] == -100, 0.0) for side in ("chosen", "rejected")))
    packed.attach_reference(values)
    padded.attach_reference(values)
    model = in_float64(AutoModelForCausalLM.from_pretrained(folder))
    rows = [0, 1]  # two packed rows: several pairs each
    pairs = [k for row in rows for k in packed.rows[row]]
    assert len(pairs) > len(rows)
    results = []
    for batch in (Pairs()([packed[row] for row in rows]), Pairs()([padded[k] for k in pairs])):
        model.zero_grad()
        out = DPO(beta=0.3)(model, batch)
        out["loss"].backward()
        assert out["num_items"].item() == len(pairs)
        results.append((out["loss"].detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-9, atol=1e-15)


def test_a_dataset_of_other_rows_is_one_line(folder, tmp_path):
    import subprocess
    import sys

    for more, says in ((["data.train.format=chat", "data.train.files=recipes/data/chat.jsonl",
                         "data.collate={_target_: launcher.data.collate.Packed}"], "data.train"),
                       ([f"data.train={{_target_: launcher.data.text.TextStream, tokenizer: {folder}, files: "
                         f"recipes/data/pairs.jsonl, format: preference, max_len: 256}}"],
                        "data.train: step.loss_type sigmoid needs the reference's"),
                       (["strategy=fsdp", "parallel.pp=2", "nproc_per_node=2"], "parallel.pp")):
        run_dir = tmp_path / str(len(list(tmp_path.iterdir())))
        done = subprocess.run([sys.executable, "-m", "launcher", str(RECIPE), *args(folder, run_dir, *more)],
                              cwd=REPO, capture_output=True, text=True, timeout=paced(300))
        assert done.returncode == 2, done.stderr[-2000:]
        said = [line for line in done.stderr.splitlines() if line.startswith("launcher: ")]
        assert said and said[0].startswith(f"launcher: {says}"), done.stderr[-1000:]


def test_with_lora_the_reference_is_the_base_with_its_adapters_disabled(folder, one_process, tmp_path):
    """Adapters built away from zero (init_lora_weights: false): the policy differs from the base at step 1 (its
    rewards are not 0), and the reference kept is the base's, the plain run's to rounding."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from launcher.recipe import load
    from launcher.run.train import train

    config = OmegaConf.load(RECIPE)
    config.model = {"_target_": "peft.get_peft_model", "model": dict(config.model),
                    "peft_config": {"_target_": "peft.LoraConfig", "r": 4, "lora_alpha": 8,
                                    "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM",
                                    "init_lora_weights": False}}
    OmegaConf.save(config, tmp_path / "lora.yaml")
    run_dir = tmp_path / "lora"
    more = [f"model.model.config.pretrained_model_name_or_path={folder}", f"checkpoint.init_from={folder}",
            f"data.train.tokenizer={folder}", "trainer.log_every=1", "trainer.max_steps=1"]
    given = [a for a in args(folder, run_dir) if not a.startswith("model.")]
    train(load(tmp_path / "lora.yaml", [*given, *more, *float64("peft.get_peft_model")]))
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["train/rewards/chosen"]) > 1e-6, first
    ours, plain = (load_file(str(next((d / "reference").glob("*/part-0.safetensors")))) for d in (run_dir, one_process))
    assert torch.equal(ours["index"], plain["index"])
    torch.testing.assert_close(ours["chosen"], plain["chosen"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours["rejected"], plain["rejected"], rtol=1e-12, atol=1e-12)
