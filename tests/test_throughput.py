"""Throughput, MFU and memory figures: where the model's FLOPs and the device's peak come from."""

import torch
from torch import nn

from launcher.observe import throughput
from launcher.loggers import format_values
from recipes.components.gpt import GPT


class PerToken(nn.Module):
    flops_per_token = 100


def test_the_model_states_its_flops_per_sample_or_per_token():
    gpt = GPT(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0, bias=False)
    assert throughput.model_flops_per_sample(gpt, 16) == gpt.flops_per_token() * 16
    assert throughput.model_flops_per_sample(gpt, None) is None  # tokens per sample unknown
    assert throughput.model_flops_per_sample(PerToken(), 8) == 800
    assert throughput.model_flops_per_sample(nn.Linear(2, 2), 8) is None


def test_peak_from_the_recipe_a_known_gpu_or_unknown(monkeypatch):
    cpu = torch.device("cpu")
    assert throughput.peak_flops(cpu, 2.5) == 2.5e12
    assert throughput.peak_flops(cpu, None) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert throughput.peak_flops(torch.device("cuda:0"), None) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert throughput.peak_flops(torch.device("cuda:0"), None) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert throughput.peak_flops(torch.device("cuda:0"), None) is None


def test_rates_of_an_interval():
    rates = throughput.Throughput(samples_per_step=64, tokens_per_sample=10, flops_per_sample=1e6,
                                  peak_flops_all_devices=2 * 1e9)
    values = rates.values(steps=50, seconds=2.0)
    assert values["train/samples_per_s"] == 1600 and values["train/tokens_per_s"] == 16000
    assert values["train/mfu"] == 1600 * 1e6 / 2e9
    assert "train/mfu" not in throughput.Throughput(64, 10, 1e6, None).values(50, 2.0)
    line = format_values(values)
    assert "samples/s 1,600" in line and "tokens/s 16,000" in line and "mfu 80.0%" in line
    assert format_values({"train/max_memory_gib": 1.5}) == "max mem 1.50 GiB"


def test_tokens_per_s_counts_the_real_tokens_of_padded_and_packed_batches():
    """Batches of token rows are counted at the read: the attention_mask's ones, or packed rows' document_ids
    >= 0, per sample (row) of the batches, times the global samples; a tuple batch has no tokens/s without
    data.tokens_per_sample. The ranks of a tensor-parallel group hold the same batch: a whole run under
    fsdp x tp 2 shows it (tests/test_text_sft.py)."""
    from launcher.model.step import Result
    from launcher.run.metrics import TrainMeter

    def rates(batches, tokens_per_sample=None, ranks=1):
        meter = TrainMeter({}, torch.device("cpu"), throughput.Throughput(2 * ranks, tokens_per_sample))
        meter.start(0)
        for batch in batches:  # one micro-batch a step
            meter.add(torch.tensor(1.0), None, Result(torch.tensor(1.0), None, None, None), batch)
            meter.step_done(None)
        values = meter.read(lambda t: t, 1e-3)
        return values.get("train/tokens_per_s", 0.0) / values["train/samples_per_s"] * 2 * ranks * len(batches)

    ids = torch.zeros(2, 5, dtype=torch.long)
    padded = {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    packed = {"input_ids": ids, "document_ids": torch.tensor([[0, 0, 1, 1, -1], [0, 1, 1, 1, 2]])}
    assert abs(rates([padded, packed]) - (8 + 9)) < 1e-3  # tokens in the interval, whatever its seconds
    # two data-parallel ranks, each with this batch (the all-reduce a mean): the global batch holds twice its tokens
    assert abs(rates([padded], ranks=2) - 16) < 1e-3
    assert rates([(torch.zeros(2, 3), torch.zeros(2))]) == 0.0  # no tokens/s for samples alone
    assert abs(rates([(torch.zeros(2, 3), torch.zeros(2))], tokens_per_sample=7) - 14) < 1e-3
    assert abs(rates([{"input_ids": ids}], tokens_per_sample=7) - 14) < 1e-3  # no mask: the recipe's figure
