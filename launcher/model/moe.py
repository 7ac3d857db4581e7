"""Mixture-of-experts layers of a transformers model, watched: what the run says of them at start, and how
evenly their routers spread the tokens, logged once per interval.

A layer's experts are one module holding the experts' weights as 3-D parameters ([experts, out, in]) and
`num_experts` (transformers 5's experts modules: Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3 and their kin),
called as `experts(hidden_states, top_k_index, top_k_weights)`, with `top_k_index` [tokens, top k] the
experts its router chose for each token. A forward pre-hook on each adds those choices into a device
tensor of counts per layer and expert (`index_add_`: no host read, unlike bincount on CUDA), in training
forwards only: not in evaluation, and not again when activation checkpointing recomputes a layer during
backward; the batch's padding (told by the meter before each forward, as it finds it for tokens/s) is routed
but not counted. The loop's meter reads the counts with its other values, in the interval's one host read
(summed over the ranks there: a share is the same of a sum as of a mean), and starts them again.

A share is the fraction of the layer's tokens routed to an expert: each token goes to `top k` experts, so
the shares sum to top k, an even load gives each top k / experts, and a router that sends every token to
one expert gives that one 1.0. Logged: each layer's largest and smallest share (`moe/load_max/layer_<i>`,
`moe/load_min/layer_<i>`, i the layer's index in the model) and their means over the layers
(`moe/load_max`, `moe/load_min`)."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn


def experts_of(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The model's experts modules with their names, in order. A peft wrapper around one (LoRA on its 3-D weights)
    is passed over for the module holding the weights."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(module, "num_experts", None), int)
            and any(p.dim() == 3 for p in module.parameters(recurse=False))]


def described(model: nn.Module) -> Optional[str]:
    """The line said at start of an MoE model: its layers, experts, top k, shared experts, and whether the
    router's load-balancing loss is trained; None for a model without experts."""
    found = experts_of(model)
    if not found:
        return None
    config = getattr(_hf_model(model), "config", None)
    counts = sorted({module.num_experts for _, module in found})
    layers = f"{len(found)} layer{'s' if len(found) > 1 else ''} of {'/'.join(map(str, counts))} experts"
    top_k = getattr(config, "num_experts_per_tok", None)
    shared = getattr(config, "n_shared_experts", None) or 0
    parts = [layers + (f", top {top_k}" if top_k else "") + (f", {shared} shared" if shared else "")]
    groups = getattr(config, "n_group", None)
    if groups and groups > 1:
        parts[0] += f", routed within the best {config.topk_group} of {groups} groups"
    return f"moe: {parts[0]}; {_balance(model, config)}" + _lora(model, found)


def _lora(model: nn.Module, found: List[Tuple[str, nn.Module]]) -> str:
    """Of a peft model: whether LoRA adapts the experts' own 3-D weights (peft wraps each such parameter's module
    in a ParamWrapper, under whose `base_layer` the experts module then is)."""
    if not hasattr(model, "peft_config"):
        return ""
    if any(name.endswith(".base_layer") for name, _ in found):
        return "; LoRA adapts the experts' weights (peft's target_parameters) besides its target modules"
    return ("; LoRA adapts its target modules alone, the experts' weights stay frozen (peft's target_parameters, "
            "e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj], adapts them)")


def _balance(model: nn.Module, config) -> str:
    """Whether the model adds its router's load-balancing loss to the loss it returns (transformers' MoE models
    do when `output_router_logits` is set, scaled by `router_aux_loss_coef`)."""
    hf_model = _hf_model(model)
    coef = getattr(hf_model, "router_aux_loss_coef", None)
    if coef is None:
        return f"the router's load-balancing loss: none in {type(hf_model or model).__name__}"
    if not getattr(config, "output_router_logits", False):
        return ("the router's load-balancing loss is not trained (output_router_logits false; "
                "model.config.output_router_logits=true trains it)")
    return f"the router's load-balancing loss is trained (coef {coef:g}; in train/loss)"


def _hf_model(model: nn.Module) -> Optional[nn.Module]:
    """The transformers model inside (a peft model's base model), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def watched(model: nn.Module, device: torch.device, stages: int) -> Tuple[Optional["ExpertLoad"], Optional[str]]:
    """The expert load the run logs (None for a model without experts), and a line to say. Not under pipeline
    stages: each stage counts its own layers, and the pipeline's reduction keeps its last stage's values."""
    if not experts_of(model):
        return None, None
    if stages > 1:
        return None, "moe: the expert load is not logged under parallel.pp (each stage counts its own layers)"
    return ExpertLoad(model, device), None


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer since the last read, on the device."""

    def __init__(self, model: nn.Module, device: torch.device):
        found = experts_of(model)
        self.layers = [_layer_index(name, i) for i, (name, _) in enumerate(found)]
        self.experts = [module.num_experts for _, module in found]
        # one column more than the most experts: where an index equal to num_experts (transformers' mark of a
        # token no expert here takes) is counted, and left out
        self.counts = torch.zeros(len(found), max(self.experts) + 1, dtype=torch.int64, device=device)
        hf_model = _hf_model(model)
        top_k = getattr(getattr(hf_model, "config", None), "num_experts_per_tok", None)
        self.top_k = [top_k or 0] * len(found)  # and from the routers' output shapes, as they run
        self.handles = [module.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                        for i, (_, module) in enumerate(found)]
        # Where the batch's real tokens are, flattened as the experts see them (`tokens`, told before each forward):
        # a padding position, routed like any other, is not counted, else the load would depend on how the batch is
        # split into padded parts (one process's 32 rows against 2 ranks' 16, each padded to its own longest).
        self.real: Optional[torch.Tensor] = None

    def tokens(self, marks: Optional[Tuple[torch.Tensor, bool]]) -> None:
        """Where the next forward's real tokens are: packed rows' document_ids (>= 0: a packed batch's model gets a
        4-D mask, which cannot tell padding from a sample), or a 2-D attention_mask (not 0), as the meter finds
        them in the batch (run/metrics.py); None: every token counts. On the device, no host read."""
        if marks is None:
            self.real = None
            return
        tensor, documents = marks
        self.real = ((tensor >= 0) if documents else (tensor != 0)).reshape(-1)

    def _hook(self, layer: int):
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # recomputed in backward (activation checkpointing), the same tokens are routed again: counted once
            if not module.training or torch._C._current_graph_task_id() != -1:
                return
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            if not isinstance(index, torch.Tensor):
                return
            self.top_k[layer] = index.shape[-1] if index.dim() > 1 else 1
            chosen = index.reshape(-1).to(self.counts.device, non_blocking=True)
            real = self.real
            if real is not None and real.numel() == index.shape[0]:  # a weight per routed slot: 1, or 0 for padding
                weight = real.to(torch.int64)[:, None].expand(index.shape[0], index.shape[-1] if index.dim() > 1 else 1)
                self.counts[layer].index_add_(0, chosen, weight.reshape(-1).to(self.counts.device, non_blocking=True))
            else:
                self.counts[layer].index_add_(0, chosen, torch.ones_like(chosen))
        return count

    def packed(self) -> torch.Tensor:
        """The counts, flat, for the meter's one reduction and host read."""
        return self.counts.reshape(-1).float()

    def values(self, read: Sequence[float]) -> Dict[str, float]:
        """The logged shares from the counts read (summed or averaged over the ranks alike)."""
        width = self.counts.shape[1]
        out: Dict[str, float] = {}
        highest, lowest = [], []
        for i, layer in enumerate(self.layers):
            row = read[i * width:i * width + self.experts[i]]
            tokens = sum(row) / self.top_k[i] if self.top_k[i] else 0
            if not tokens:
                continue
            shares = [c / tokens for c in row]
            out[f"moe/load_max/layer_{layer}"], out[f"moe/load_min/layer_{layer}"] = max(shares), min(shares)
            highest.append(max(shares))
            lowest.append(min(shares))
        if not highest:
            return {}
        return {"moe/load_max": sum(highest) / len(highest), "moe/load_min": sum(lowest) / len(lowest), **out}

    def mark(self) -> torch.Tensor:
        return self.counts.clone()

    def back_to(self, mark: torch.Tensor) -> None:
        self.counts.copy_(mark)

    def reset(self) -> None:
        self.counts.zero_()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _layer_index(name: str, position: int) -> int:
    """The layer's index in the model (`model.layers.3.mlp.experts`: 3), else its place among the MoE layers."""
    found = re.search(r"\.(\d+)\.", f".{name}.")
    return int(found.group(1)) if found else position
