"""Per-head norms a tensor-parallel plan leaves out: found beside its column splits and given `heads_norm`.

A model that normalises each attention head's features after its query and key projections (Qwen3's, Qwen3-MoE's,
Gemma 3's q_norm and k_norm; GLM-4-MoE's with use_qk_norm) holds one norm of head_dim weights, shared by every
head. Under tp its projection split `colwise` leaves each rank its own heads, and the norm, left out of the plan,
runs right on them: the loss is one process's, but the norm's gradient on each rank is its own heads' share
alone, and the ranks' copies of its weights drift apart and from one process's (7e-6 in float64 after 6 steps of a
tiny Qwen3-MoE). Nothing fails; the weights are wrong.

Plans are copied from torchtitan's and HF's (transformers' own GLM-4-MoE plan leaves its q_norm and k_norm out), so
`apply` looks for such norms itself. A plan that splits a Linear `colwise` and does not name a norm among its
siblings (children of the same attention block) whose weights are one head's features (head_dim: the block's own
`head_dim`, its config's, or hidden_size / num_attention_heads; a sibling named *q_norm or *k_norm whose size
divides the projection's output when the model says no head_dim) has that norm added as `heads_norm`, by the
pattern a user would write (`model.layers.*.self_attn.q_norm`), and the start line says so.

Added, not refused: there is one right answer. On the rank's heads the norm computes what it does whole, and the
only thing missing is the sum of its gradient over the tp ranks, which is what `heads_norm` is (HF's plans call it
`replicated_with_grad_allreduce`); a refusal would stop every copied plan to make its user type the line the
launcher already knows. A norm the plan names, in any style, is the user's choice and left as named; a norm over
a whole projection's output (OLMo 2's q_norm, after a colwise_rep) is not per head and is not touched."""

from __future__ import annotations

import fnmatch
from typing import Dict, List, Optional

from torch import nn

NAMED = ("q_norm", "k_norm")  # the names transformers' models give them


def left_out(model: nn.Module, plan: Dict[str, str]) -> Dict[str, str]:
    """The patterns of the per-head norms beside the plan's column splits that the plan does not name, each
    with `heads_norm` (the module's docstring)."""
    names = [name for name, _ in model.named_modules() if name]
    named = {n for pattern in plan for n in _found(names, pattern)}
    out: Dict[str, str] = {}
    for pattern, style in plan.items():
        if style != "colwise":  # colwise_rep gathers its output whole: a norm after it sees every head
            continue
        for name in _found(names, pattern):
            projection = model.get_submodule(name)
            if not isinstance(getattr(projection, "base_layer", projection), nn.Linear):
                continue
            parent_name = name.rpartition(".")[0]
            parent = model.get_submodule(parent_name)
            for child, module in parent.named_children():
                full = f"{parent_name}.{child}" if parent_name else child
                if full not in named and _per_head(module, child, parent, model, projection):
                    at = pattern.rpartition(".")[0]
                    out[f"{at}.{child}" if at else child] = "heads_norm"
    return out


def _found(names: List[str], pattern: str) -> List[str]:
    return [n for n in names if fnmatch.fnmatchcase(n, pattern) and n.count(".") == pattern.count(".")]


def _per_head(module: nn.Module, name: str, block: nn.Module, model: nn.Module, projection: nn.Module) -> bool:
    """Whether `module` is a norm whose weights are one head's features."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or next(module.children(), None) is not None:
        return False
    if "norm" not in type(module).__name__.lower() and "norm" not in name.lower():
        return False
    size, head_dim = weight.numel(), _head_dim(block, model)
    if head_dim is not None:
        return size == head_dim
    out = getattr(getattr(projection, "base_layer", projection), "out_features", 0)
    return name.endswith(NAMED) and size < out and out % size == 0


def _head_dim(block: nn.Module, model: nn.Module) -> Optional[int]:
    """One head's features: the attention block's own `head_dim` (HF's attention modules carry it), its config's,
    or the model config's hidden_size / num_attention_heads; None when nothing says."""
    for holder in (block, getattr(block, "config", None), getattr(model, "config", None)):
        size = getattr(holder, "head_dim", None)
        if isinstance(size, int) and size > 0:
            return size
    config = getattr(model, "config", None)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
