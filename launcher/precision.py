"""Mixed precision: the autocast context, and the gradient scaler for fp16."""

from __future__ import annotations

import contextlib

import torch

from launcher.errors import UserError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
