"""A peft model (LoRA) seen as the model it adapts: checkpoint.init_from reads the base model's weights (an
HF folder of the pretrained model) into it, and leaves its adapters as they were built.

peft wraps the base model (`base_model.model.` before every key) and each adapted layer (its weight under
`.base_layer.`, the adapters under `.lora_A.<adapter>.`, `.lora_B.<adapter>.`, ...): a key of the peft
model is the base model's with those added."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import nn

PREFIX = "base_model.model."
ADAPTER_PARTS = (".lora_", ".hada_", ".lokr_", ".ia3_", ".oft_", ".boft_", ".vera_")


def is_adapted(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def base_view(model: nn.Module, state: Dict[str, object]) -> Optional[Tuple[Dict[str, object], Dict[str, str], List[str]]]:
    """For a peft model: its `state` keyed by the base model's names, the way back to its own names, and its
    adapters' keys (which a base model's weights do not hold); None for any other model."""
    if not is_adapted(model):
        return None
    base, back, adapters = {}, {}, []
    for key, value in state.items():
        if any(part in key for part in ADAPTER_PARTS):
            adapters.append(key)
            continue
        name = base_name(key)
        base[name], back[name] = value, key
    return base, back, adapters


def base_name(key: str) -> str:
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    return name.replace(".base_layer.", ".")
