"""Packing changes no result (DESIGN invariant 12): one SGD step over the same samples, packed into rows
(launcher/data/text/packing.py, launcher.data.collate.Packed) and padded one per row (Pad), gives the same
loss and the same weights on tiny Llama, Qwen2 and GPT-2 models, under transformers' sdpa and eager
attention: the proof that no token attends across samples and that no sample's first token is predicted
from the one before. The same comparison without the mask (position_ids alone) or with the boundary
labels kept must fail, and does; a model that cannot take the mask is one line at the first batch."""

import copy
import inspect
import random

import pytest
import torch

from launcher.data.collate import Packed, Pad
from launcher.data.text.packing import pack
from launcher.errors import UserError
from launcher.model.packed import KEY
from launcher.model.step import ModelLoss
from launcher.run.first_batch import check
from tests import hf_zoo
from tests.float64 import in_float64
from tests.rounding import assert_within_rounding

pytest.importorskip("transformers", reason="the dev extra (transformers) is not installed")

MODELS = ["llama", "qwen2", "gpt2"]


def samples(n: int = 12, seed: int = 0) -> list:
    """Token samples of 3 to 24 tokens whose first 0 to 2 labels are not targets (a prompt)."""
    draw = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [draw.randrange(1, 256) for _ in range(draw.randint(3, 24))]
        prompt = draw.randint(0, 2)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def padded(items: list) -> dict:
    return Pad(values={"labels": -100})([{k: torch.tensor(v) for k, v in item.items()} for item in items])


def packed(items: list, max_len: int = 40) -> dict:
    return Packed()(pack(items, max_len, seed=3))


def model_of(name: str, attention: str) -> torch.nn.Module:
    """In float64, where packed and padded differ by rounding alone on any CPU (tests/rounding.py)."""
    torch.manual_seed(0)
    model = getattr(hf_zoo, name)()
    model.set_attn_implementation(attention)
    return in_float64(model)


def sgd_step(model: torch.nn.Module, batch: dict) -> tuple:
    """(loss, num_items, weights) after one SGD step of a copy of `model` on `batch`."""
    model = copy.deepcopy(model)
    out = ModelLoss()(model, batch)
    out["loss"].backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return out["loss"].detach(), out["num_items"], {k: v.detach() for k, v in model.state_dict().items()}


def same(a: tuple, b: tuple) -> None:
    assert_within_rounding({"loss": a[0]}, {"loss": b[0]}, steps=1)
    assert a[1] == b[1]
    assert_within_rounding(a[2], b[2], steps=1)


def differ(a: tuple, b: tuple) -> bool:
    try:
        same(a, b)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_one_sgd_step_packed_is_the_step_padded(name, attention):
    items = samples()
    batch = packed(items)
    assert batch["input_ids"].shape[0] < len(items) // 2  # several samples a row
    model = model_of(name, attention)
    same(sgd_step(model, padded(items)), sgd_step(model, batch))


@pytest.mark.parametrize("name", MODELS)
def test_without_the_mask_samples_see_each_other_and_the_comparison_fails(name):
    """position_ids alone (what a padding-free row gives) on the CPU's sdpa: transformers builds a plain
    causal mask (the training forward has a cache, so it does not infer boundaries from position_ids)."""
    items = samples()
    model = model_of(name, "sdpa")
    batch = packed(items)
    leaky = {k: v for k, v in batch.items() if k != KEY}
    assert differ(sgd_step(model, padded(items)), sgd_step(model, leaky))


def test_a_sample_s_first_label_kept_is_scored_from_the_sample_before_and_the_comparison_fails():
    items = samples()
    model = model_of("llama", "sdpa")
    batch = packed(items)
    starts = (batch["position_ids"] == 0) & (batch[KEY] > 0)
    kept = {**batch, "labels": torch.where(starts, batch["input_ids"], batch["labels"])}
    assert differ(sgd_step(model, padded(items)), sgd_step(model, kept))


def test_the_step_counts_the_label_tokens_the_padded_batch_counts():
    items = samples(n=40, seed=1)
    count = ModelLoss()(model_of("llama", "sdpa"), padded(items))["num_items"]
    assert count == sum(sum(label != -100 for label in item["labels"][1:]) for item in items)
    assert ModelLoss()(model_of("llama", "sdpa"), packed(items))["num_items"] == count


def first_batch(model, batch, step=None) -> list:
    """What the check before training says of this batch (launcher/run/first_batch.py)."""
    return check(lambda: batch, lambda b: b, model, step or ModelLoss(), {},
                 lambda: torch.autocast("cpu", enabled=False), torch.device("cpu"))


def test_the_first_batch_check_passes_a_model_that_keeps_samples_apart():
    assert first_batch(model_of("qwen2", "eager"), packed(samples())) == []


def test_an_attention_that_reads_no_4d_mask_is_one_line():
    model = model_of("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError, match="model: LlamaForCausalLM uses attn_implementation 'flash_attention_2', to "
                                        "which packed rows give no sample boundaries here .*set model.attn_implementation: "
                                        "sdpa, or data.train.packing: false"):
        first_batch(model, packed(samples()))


def test_an_moe_model_training_its_router_loss_is_one_line():
    """transformers' MoE models weigh the load-balancing loss by a 2-D mask: a packed row's 4-D one is refused
    at the first batch in one line naming both keys, not a shape error from inside the model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                                               moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                                               output_router_logits=True))
    with pytest.raises(UserError, match="data.train: packed rows give Qwen3MoeForCausalLM a 4-D attention mask, and "
                                        "its router's load-balancing loss .*set data.train.packing: false, or "
                                        "model.config.output_router_logits: false"):
        first_batch(model, packed(samples()))
    model.config.output_router_logits = False
    assert first_batch(model, packed(samples())) == []


class Causal(torch.nn.Module):
    """A causal LM of its own whose forward takes attention_mask and position_ids, and may ignore the mask."""

    def __init__(self, honours: bool, takes_positions: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256)
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.honours = honours
        if not takes_positions:
            self.forward = self.forward_without_positions

    def forward(self, input_ids, labels, attention_mask=None, position_ids=None):
        x = self.embed(input_ids)
        length = x.shape[1]
        allowed = attention_mask if self.honours else torch.ones(length, length, dtype=torch.bool).tril()[None, None]
        allowed = allowed.expand(x.shape[0], 2, length, length).reshape(-1, length, length)
        x = x + self.attention(x, x, x, attn_mask=~allowed, need_weights=False)[0]
        logits = self.out(x)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), labels[:, 1:].reshape(-1), ignore_index=-100)

    def forward_without_positions(self, input_ids, labels, attention_mask=None):
        return self.forward(input_ids, labels, attention_mask)


def test_a_model_that_ignores_the_mask_is_caught_at_the_first_batch():
    batch = packed(samples())
    assert first_batch(Causal(honours=True), batch) == []
    with pytest.raises(UserError, match="data.train: the model lets packed samples attend to each other: changing the "
                                        "first sample of each row changes the loss of the others from .* set "
                                        "data.train.packing: false"):
        first_batch(Causal(honours=False), batch)


def test_a_forward_without_position_ids_is_one_line():
    with pytest.raises(UserError, match=r"data.train: packed rows need a model whose forward takes attention_mask "
                                        r"\(a 4-D mask\) and position_ids, and Causal.forward takes no position_ids"):
        first_batch(Causal(honours=True, takes_positions=False), packed(samples()))


def test_a_lora_model_takes_packed_rows_as_the_model_it_adapts():
    """peft's PeftModelForCausalLM names no position_ids in its forward and passes them on in **kwargs."""
    peft = pytest.importorskip("peft", reason="the dev extra (peft) is not installed")
    items = samples()
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", init_lora_weights=False)
    model = peft.get_peft_model(model_of("llama", "sdpa"), config)
    assert "position_ids" not in inspect.signature(model.forward).parameters
    same(sgd_step(model, padded(items)), sgd_step(model, packed(items)))
    assert first_batch(model, packed(items)) == []
