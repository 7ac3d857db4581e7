"""Mixed precision: the autocast context, the gradient scaler for fp16, and fp8 matmuls (torchao's Float8Linear)."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from launcher.errors import UserError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: bf16 around
FP8_CAPABILITY = (8, 9)  # CUDA's fp8 matmuls: Ada (L4, RTX 4090) and Hopper (H100) and newer
HEADS = ("lm_head", "output", "head")  # output layers stay in bf16 (torchtitan's default): logits need the range


def check_fp8(device: torch.device) -> None:
    """Before anything is built: fp8 needs a GPU with fp8 matmuls, and torchao."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise UserError(f"precision: fp8 needs an NVIDIA GPU with fp8 matmuls (compute capability 8.9 or newer: H100, "
                        f"L4, RTX 4090), and this run is on {name}; use precision=bf16")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UserError("precision: fp8 computes through torchao, which is not installed: pip install "
                        "'launcher[fp8]'") from None


def to_float8(model: torch.nn.Module, sharded: bool) -> int:
    """Swap the model's Linear layers whose sizes fp8 matmuls take (multiples of 16), less its output head, for
    torchao's Float8Linear (dynamic scaling; under FSDP2 the weights are gathered in fp8). Their parameters and
    state_dict keys stay as they are. Returns how many were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(module: torch.nn.Module, name: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0
                and module.out_features % 16 == 0 and name.rpartition(".")[2] not in HEADS)

    before = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=sharded),
                               module_filter_fn=eligible)
    return before - sum(type(m) is torch.nn.Linear for m in model.modules())


def float8_scales_ahead(model: torch.nn.Module) -> Callable[[], None]:
    """Under FSDP2, which gathers the weights in fp8: after each optimizer step, every fp8 weight's scale from
    one fused amax over all of them (torchao's precompute_float8_dynamic_scale_for_fsdp, as torchtitan does).
    Without it each gather reduced its weight's amax first, a few unfused kernels a Linear, forward and
    backward: on one H200 a 1B Llama's step under fsdp took 417.75 ms without and 292.50 ms with
    (docs/performance.md). The scales are the weights' own: they are computed from the stepped weights."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)


def tf32(allowed, device: torch.device) -> None:
    """The recipe's `tf32` for fp32 matmuls and convolutions on CUDA (Ampere and newer compute them in TF32,
    with a 10-bit mantissa, when allowed); None leaves torch's defaults (convolutions in TF32, matmuls not)."""
    if allowed is None or device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed


class Precision:
    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.dtype = DTYPES[name]
        self.device_type = device.type
        if name == "fp16" and device.type != "cuda":
            raise UserError(f"precision: fp16 needs a CUDA device and this run is on {device}; use bf16 or fp32")
        if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError(f"precision: bf16 is not supported by {torch.cuda.get_device_name(device)}; use fp16 or fp32")
        # GradScaler.step reads found_inf on the host unless the optimizer is fused (it supports amp scaling).
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
        self.after_step: Optional[Callable[[], None]] = None  # fp8 under FSDP2: the weights' scales, ahead

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Call before clipping so that the norm is the true gradient's."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        if self.after_step is not None:
            self.after_step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
