"""trainer.loss_chunk (launcher/model/chunked.py): a transformers causal LM's output layer and loss a chunk of tokens at
a time. The same training as the whole loss (float64, within rounding: tests/rounding.py) for a tiny Qwen3 and a
Llama with tied embeddings on packed rows with padding and answer-only labels, trained in this process by the
launcher's own loop; a lower measured peak (torch's memory tracker, as launcher/observe/memory.py measures a CPU
step) by at least two whole logits tensors on a model whose logits dominate; the models it cannot do, one line."""

import copy

import pytest
import torch

from tests import hf_zoo
from tests.conftest import QUICKSTART, REPO, in_this_process, trained_here
from tests.rounding import assert_within_rounding

transformers = pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

RECIPE = str(REPO / "tests" / "packed.yaml")  # a float64 model on packed rows of byte passages, 2 labels unscored
STEPS = 4
# rows of 56 to 63 tokens (a batch padded to its longest), two micro-batches: chunks of 50 end inside rows and
# across them, the last one short
RUN = [RECIPE, "devices=cpu", f"trainer.max_steps={STEPS}", f"trainer.log_every={STEPS}", "checkpoint.every=null",
       "data.train={_target_: tests.packed_tokens.PackedTokens, row_len: 63, max_len: 40}", "data.batch_size=4",
       "trainer.grad_accum_steps=2"]


def in_process(folder, args):
    from launcher.recipe import load
    from launcher.run.train import train

    return train(load(args[0], [*args[1:], f"run_dir={folder}"]))


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("model", [
    ["model.of=tests.hf_zoo.qwen3"],
    ["model.of=tests.hf_zoo.llama", "model.tie_word_embeddings=true"],  # the output layer is the embedding
])
def test_chunked_loss_trains_to_the_whole_loss_weights(tmp_path, model):
    whole = in_process(tmp_path / "whole", [*RUN, *model])
    chunked = in_process(tmp_path / "chunked", [*RUN, *model, "trainer.loss_chunk=50"])
    assert chunked["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-12)
    assert_within_rounding(weights(tmp_path / "whole" / "model.pt"), weights(tmp_path / "chunked" / "model.pt"), STEPS)


def tiny(family: str, **extra) -> torch.nn.Module:
    """A tiny transformers causal LM of `family` (Gemma, Gemma3, Qwen3Moe) in the sizes of tests/hf_zoo.py."""
    config = getattr(transformers, f"{family}{'TextConfig' if family == 'Gemma3' else 'Config'}")
    model = getattr(transformers, f"{family}ForCausalLM")
    return model(config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128, **extra))


def lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))


@pytest.mark.parametrize("build", [
    lambda: hf_zoo.llama(),  # tied embeddings
    lambda: tiny("Gemma"),  # its embedding scaled, tied
    lambda: tiny("Gemma3"),  # no logit cap, as published
    lambda: tiny("Qwen3Moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=True),
    lambda: lora(hf_zoo.qwen3()),  # the chunks go in the model peft adapts
], ids=["llama", "gemma", "gemma3", "qwen3-moe", "qwen3-lora"])
def test_the_step_counts_the_same_tokens_and_gets_the_same_loss_and_gradients(build):
    """Labels that score a row's first token (which the causal shift leaves out of the count), a row padded at its end,
    chunks of 7 tokens across the rows: the step's count, the loss (an MoE's with its load-balancing term) and every
    gradient are the whole loss's."""
    from launcher.model import chunked
    from launcher.model.step import ModelLoss
    from tests.float64 import in_float64

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 20))
    labels, mask = ids.clone(), torch.ones_like(ids)
    labels[1, 15:], mask[1, 15:] = -100, 0
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    whole = in_float64(build())
    chunks = copy.deepcopy(whole)
    chunked.install(chunks, 7)
    a, b = ModelLoss()(whole, batch), ModelLoss()(chunks, batch)
    a["loss"].backward()
    b["loss"].backward()
    assert b["num_items"].item() == a["num_items"].item() == 19 + 14
    assert b["output"].logits is None
    assert (a["loss"] - b["loss"]).abs().item() <= 1e-14
    for (name, p), q in zip(whole.named_parameters(), chunks.parameters()):
        if p.grad is not None or q.grad is not None:  # (an expert no token was routed to has none)
            assert (p.grad - q.grad).abs().max().item() <= 1e-14, name


def test_a_model_that_caps_its_logits_is_one_line():
    from launcher.errors import UserError
    from launcher.model import chunked

    with pytest.raises(UserError) as info:
        chunked.install(tiny("Gemma2"), 64)
    assert str(info.value).startswith("trainer.loss_chunk: Gemma2ForCausalLM caps its logits")


def test_chunks_lower_the_measured_peak_of_a_step_by_two_whole_logits_tensors():
    """A Llama of 32 features and a vocabulary of 8,192 on 2 rows of 512 tokens: its logits (float32, 32 MiB) are
    most of a step's memory. The whole loss holds the logits and their log-softmax at once (and in backward their
    gradients); chunks of 64 tokens hold a chunk's (2 MiB each). So the chunks' peak is lower by at least two whole
    logits tensors."""
    from launcher.model import chunked
    from launcher.model.step import ModelLoss
    from launcher.observe.memory import tracker

    torch.manual_seed(0)
    vocab, rows, length, chunk = 8192, 2, 512, 64
    ids = torch.randint(0, vocab, (rows, length))
    batch = {"input_ids": ids, "labels": ids.clone()}
    model = hf_zoo.llama(vocab_size=vocab)
    model.config.max_position_embeddings = length
    peaks = {}
    for name in ("whole", "chunked"):
        one = copy.deepcopy(model)
        if name == "chunked":
            chunked.install(one, chunk)
        optimizer = torch.optim.SGD(one.parameters(), lr=0.1)
        step = ModelLoss()
        with tracker(one, optimizer, False) as found:
            step(one, batch)["loss"].backward()
            optimizer.step()
        peaks[name] = next(iter(found.get_tracker_snapshot("peak").values()))["Total"]
    logits = rows * length * vocab * 4
    assert peaks["whole"] - peaks["chunked"] >= 2 * logits, (peaks, logits)  # measured: 2.8 of them


def test_validation_is_the_whole_loss_s_and_the_planner_says_it_does_not_plan_the_key(tmp_path):
    val = ["data.val={_target_: tests.packed_tokens.PackedTokens, n: 32, row_len: 63, max_len: 40, seed: 1}",
           "trainer.max_steps=2", "trainer.log_every=2", "logging.memory_plan=true"]
    said = {name: trained_here(*RUN, "model.of=tests.hf_zoo.qwen3", *val, f"run_dir={tmp_path / name}", *extra)
            for name, extra in {"whole": [], "chunked": ["trainer.loss_chunk=50"]}.items()}
    evals = {name: [line for line in out.splitlines() if line.startswith("eval at step 2")]
             for name, out in said.items()}
    assert len(evals["whole"]) == 1 and evals["chunked"] == evals["whole"], evals
    assert "logging.memory_plan: python -m launcher.plan does not plan trainer.loss_chunk yet" in said["chunked"]


@pytest.mark.parametrize("args, model", [
    ([str(QUICKSTART)], "MLP"),  # not a transformers model
    ([str(REPO / "tests" / "hf_zoo.yaml"), "model._target_=tests.hf_zoo.t5"], "T5ForConditionalGeneration"),
])
def test_a_model_the_chunks_cannot_do_is_one_line(tmp_path, args, model):
    code, out, err = in_this_process(*args, "devices=cpu", "trainer.max_steps=1", f"run_dir={tmp_path}",
                                     "trainer.loss_chunk=64")
    lines = [line for line in err.splitlines() if "trainer.loss_chunk" in line]
    assert code == 2 and len(lines) == 1 and f"trainer.loss_chunk: {model} " in lines[0], err[-2000:]


@pytest.mark.slow
def test_chunks_under_cp_x2_end_with_one_process_weights(tmp_path):
    """parallel.cp=2 (two gloo processes): each rank chunks its own part of every row (chunks of 24 of its 32 tokens,
    the last one short), and the run ends with one process's weights, trained with the whole loss."""
    from tests.several_runs import several

    run = [RECIPE, "devices=cpu", "model.of=tests.hf_zoo.qwen3", "trainer.max_steps=4", "trainer.log_every=4",
           "checkpoint.every=null"]
    in_process(tmp_path / "one", run)
    cp = [*run, "strategy=fsdp", "parallel.cp=2", "trainer.loss_chunk=24", f"run_dir={tmp_path / 'cp'}"]
    results = several({"cp": cp}, tmp_path)[0]
    assert results["cp"]["error"] is None, results["cp"]
    assert "trainer.loss_chunk: Qwen3ForCausalLM's output layer and loss computed 24 tokens" in results["cp"]["said"]
    assert_within_rounding(weights(tmp_path / "one" / "model.pt"), weights(tmp_path / "cp" / "model.pt"), 4)
