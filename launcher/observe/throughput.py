"""Throughput in the logs: samples/s, tokens/s, model FLOPs utilisation (MFU), and on CUDA the peak
memory allocated. Everything here is host arithmetic or an allocator counter: no device sync.

MFU = achieved model FLOPs / (peak FLOPs per device x devices). The model's FLOPs come from the
model itself: a `flops_per_sample` or a `flops_per_token` (times `data.tokens_per_sample`), as a
number or a method taking no arguments. The peak is `logging.peak_tflops` when the recipe sets it,
otherwise the dense bf16 peak of a known GPU (the convention of nanoGPT and torchtitan, whatever
the run's precision), otherwise unknown, and then MFU is not logged.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

# Dense bf16 tensor-core peaks, TFLOP/s, by a piece of torch.cuda.get_device_name(); first match wins.
PEAK_BF16_TFLOPS = (
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("GH200", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A10G", 70.0), ("L40S", 362.0), ("L4", 121.0),
    ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("V100", 125.0),
)


def model_flops_per_sample(model: nn.Module, tokens_per_sample: Optional[int]) -> Optional[float]:
    """Training FLOPs (forward and backward) of one sample, as the model states them; None if it does not."""
    per_sample = _number(getattr(model, "flops_per_sample", None))
    if per_sample is not None:
        return per_sample
    per_token = _number(getattr(model, "flops_per_token", None))
    return per_token * tokens_per_sample if per_token is not None and tokens_per_sample else None


def peak_flops(device: torch.device, recipe_tflops: Optional[float]) -> Optional[float]:
    """One device's peak FLOP/s: the recipe's figure, else a known GPU's, else None."""
    if recipe_tflops is not None:
        return recipe_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for piece, tflops in PEAK_BF16_TFLOPS:
            if piece in name:
                return tflops * 1e12
    return None


class Throughput:
    """The rates of one log interval, from its steps and seconds."""

    def __init__(self, samples_per_step: int, tokens_per_sample: Optional[int] = None,
                 flops_per_sample: Optional[float] = None, peak_flops_all_devices: Optional[float] = None,
                 device: torch.device = torch.device("cpu"), groups: int = 1):
        self.samples_per_step = samples_per_step
        self.groups = groups  # replica groups (fault tolerance): each computes its own 1/groups of every batch
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self.peak = peak_flops_all_devices
        self.device = device

    def values(self, steps: int, seconds: float, real_per_sample: Optional[float] = None,
               trained: Optional[float] = None) -> Dict[str, float]:
        """`real_per_sample`: the tokens that are not padding in a sample (a row, when packed) of the interval,
        as counted in batches of token rows, so that tokens/s is what was trained on, packed or padded, and
        whatever the layout (a tensor-parallel group's ranks hold the same batch); else data.tokens_per_sample.
        `trained`: the global batches the steps trained (fewer where replica groups were down), else `steps`."""
        samples_per_s = (steps if trained is None else trained) * self.samples_per_step / max(seconds, 1e-9)
        out = {"train/samples_per_s": samples_per_s}
        per_sample = real_per_sample if real_per_sample is not None else self.tokens_per_sample
        if per_sample:
            out["train/tokens_per_s"] = samples_per_s * per_sample
        if self.flops_per_sample and self.peak:  # (the peak: this group's devices, which compute its share alone)
            own = steps * self.samples_per_step / self.groups / max(seconds, 1e-9)
            out["train/mfu"] = own * self.flops_per_sample / self.peak
        if self.device.type == "cuda":
            out["train/max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out


def _number(value) -> Optional[float]:
    if callable(value):
        value = value()
    return float(value) if isinstance(value, (int, float)) and value > 0 else None
