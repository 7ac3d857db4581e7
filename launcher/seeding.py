"""Seeding, and capturing and restoring every RNG a training step may draw from."""

from __future__ import annotations

import random
from typing import Any, Dict

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if np is not None:
        np.random.seed(seed % 2**32)


def capture(device: torch.device) -> Dict[str, Any]:
    """This process's RNG states, as values torch.load(weights_only=True) accepts."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def restore(state: Dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_tuples(state["python"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].cpu().numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))


def _tuples(value: Any) -> Any:
    """random.setstate needs tuples where a round trip through torch.save may give lists."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
