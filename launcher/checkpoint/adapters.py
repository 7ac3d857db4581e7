"""A peft model (LoRA) seen as the model it adapts: checkpoint.init_from reads the base model's weights (an
HF folder of the pretrained model) into it, and leaves its adapters as they were built; export merges the
adapters into the base model's weights (--merge-lora) or writes them as peft does (--format peft), from
the adapter config a run keeps in <run_dir>/adapter_config.json.

peft wraps the base model (`base_model.model.` before every key) and each adapted layer (its weight under
`.base_layer.`, the adapters under `.lora_A.<adapter>.`, `.lora_B.<adapter>.`, ...): a key of the peft
model is the base model's with those added."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from launcher.checkpoint import files, hf
from launcher.errors import UserError, shown

PREFIX = "base_model.model."
ADAPTER_PARTS = (".lora_", ".hada_", ".lokr_", ".ia3_", ".oft_", ".boft_", ".vera_")


def is_adapter_key(key: str) -> bool:
    return any(part in key for part in ADAPTER_PARTS)


def is_adapted(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def base_view(model: nn.Module, state: Dict[str, object]) -> Optional[Tuple[Dict[str, object], Dict[str, str], List[str]]]:
    """For a peft model: its `state` keyed by the base model's names, the way back to its own names, and its
    adapters' keys (which a base model's weights do not hold); None for any other model."""
    if not is_adapted(model):
        return None
    base, back, adapters = {}, {}, []
    for key, value in state.items():
        if is_adapter_key(key):
            adapters.append(key)
            continue
        name = base_name(key)
        base[name], back[name] = value, key
    return base, back, adapters


def merge_first(path: Path, key: str) -> str:
    """What to say of a peft model's weights (at `path`, `key` one of its adapters) named to initialise a model
    that is not a peft model."""
    return (f"a peft model's weights (its adapters, {key!r}, ...), and this model is not a peft model: merge "
            f"the adapters into the base model's weights first, python -m launcher.export {path} OUT --format hf "
            f"--merge-lora, and initialise from OUT (or build this model with peft, as recipes/hf_lora.yaml does)")


def base_name(key: str) -> str:
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    return re.sub(r"(\.base_layer)+\.", ".", name)  # nested where peft adapts two parameters of one module


RUN_CONFIG = "adapter_config.json"  # where a run of a peft model keeps its adapters' config (peft's file name)
WEIGHTS = "adapter_model.safetensors"


def config_of(model: nn.Module) -> Optional[dict]:
    """A peft model's adapter config as peft's save_pretrained writes it, or None for another model."""
    if not is_adapted(model):
        return None
    configs = model.peft_config
    if len(configs) != 1:
        raise UserError(f"model: a peft model with {len(configs)} adapters ({', '.join(configs)}); the launcher "
                        f"trains one")
    out = next(iter(configs.values())).to_dict()
    return {k: (sorted(v) if isinstance(v, set) else getattr(v, "value", v)) for k, v in out.items()}


def keep_config(run_dir: Path, cfg: dict) -> None:
    """What export --merge-lora and --format peft read (rank 0, once a run has built its model)."""
    files.write_text(run_dir / RUN_CONFIG, json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _adapter_name(keys) -> str:
    names = {m.group(1) for m in (re.search(r"\.lora_[AB]\.([^.]+)\.weight$", k) for k in keys) if m}
    if len(names) != 1:
        held = "no LoRA adapters" if not names else f"the adapters {shown(', '.join(sorted(names)), 120)}"
        raise UserError(f"the checkpoint holds {held}; "
                        f"--merge-lora and --format peft take one LoRA adapter")
    return names.pop()


def unmerged(cfg: dict) -> Optional[str]:
    """Why the adapters of `cfg` are not merged here, or None: LoRA on parameters (peft's target_parameters, an MoE
    model's 3-D expert weights), whose update peft shapes per expert."""
    if not cfg.get("target_parameters"):
        return None
    return (f"the adapters include LoRA on parameters ({', '.join(cfg['target_parameters'])}: peft's "
            f"target_parameters), which the launcher does not merge; write the adapters with python -m "
            f"launcher.export RUN OUT --format peft and merge them with peft (PeftModel.from_pretrained(base, "
            f"OUT).merge_and_unload())")


def adapter_keys(specs: Dict[str, object]) -> List[str]:
    return [k for k in specs if is_adapter_key(k)]


def merged(tensors: hf.Tensors, cfg: dict) -> hf.Tensors:
    """The base model's weights with each LoRA layer's update merged in (W + B A x alpha / r, as peft's
    merge_and_unload), keyed as the base model: read a shard at a time."""
    if cfg.get("peft_type") != "LORA" or cfg.get("use_dora"):
        raise UserError(f"--merge-lora: the adapters are {'DoRA' if cfg.get('use_dora') else cfg.get('peft_type')}; "
                        f"it merges plain LoRA (write them with --format peft instead)")
    if unmerged(cfg):
        raise UserError(f"--merge-lora: {unmerged(cfg)}")
    name = _adapter_name(tensors.specs)
    scale = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
    sources: Dict[str, tuple] = {}
    for key in tensors.specs:
        if is_adapter_key(key):
            if not re.search(rf"\.lora_[AB]\.{re.escape(name)}\.weight$", key):
                raise UserError(f"--merge-lora: {key!r} is an adapter it cannot merge (plain LoRA on linear layers only)")
            continue
        stem = key[:-len(".base_layer.weight")] if key.endswith(".base_layer.weight") else None
        lora = (f"{stem}.lora_A.{name}.weight", f"{stem}.lora_B.{name}.weight") if stem else ()
        sources[base_name(key)] = (key, *[k for k in lora if k in tensors.specs])

    def read(names: list) -> Dict[str, torch.Tensor]:
        got = tensors.read(sorted({k for n in names for k in sources[n]}))
        out = {}
        for n in names:
            key, *lora = sources[n]
            weight = got[key]
            if lora:
                delta = got[lora[1]].to(weight.dtype) @ got[lora[0]].to(weight.dtype)
                weight = weight + (delta.T if cfg.get("fan_in_fan_out") else delta) * scale
            out[n] = weight
        return out

    return hf.Tensors({n: tensors.specs[k[0]] for n, k in sources.items()}, read)


def adapters_only(tensors: hf.Tensors) -> hf.Tensors:
    """The adapters keyed as peft's adapter_model.safetensors keys them (the adapter's name left out)."""
    name = _adapter_name(tensors.specs)
    keys = {re.sub(rf"\.(lora_[AB])\.{re.escape(name)}\.", r".\1.", k): k for k in adapter_keys(tensors.specs)}

    def read(names: list) -> Dict[str, torch.Tensor]:
        got = tensors.read([keys[n] for n in names])
        return {n: got[keys[n]] for n in names}

    return hf.Tensors({n: tensors.specs[k] for n, k in keys.items()}, read)


def write(out: Path, tensors: hf.Tensors, cfg: dict, dtype: Optional[torch.dtype]) -> list:
    """A folder PeftModel.from_pretrained loads: adapter_config.json and adapter_model.safetensors, written
    under a hidden name and renamed (whole or absent)."""
    from safetensors.torch import save_file

    def fill(partial: Path) -> list:
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
                 for k, v in tensors.read(list(tensors.specs)).items()}
        save_file(state, str(partial / WEIGHTS), metadata={"format": "pt"})
        files.write_text(partial / RUN_CONFIG, json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        return [WEIGHTS, RUN_CONFIG]

    return files.write_folder(out, fill, "the adapters")
