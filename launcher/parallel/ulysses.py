"""Context parallelism by Ulysses (DeepSpeed-Ulysses): each rank of a cp group holds a contiguous 1/cp of every
sequence of the batch (launcher/model/sequence.py splits it), and attention, the one layer that mixes positions,
is computed exactly across the split:

1. the attention's query, key and value of this rank's part of the sequence, all heads ([B, H, L/cp, D], after
   the model's own projections, per-head norms and rotary embedding at the whole sequence's positions), go to the
   other ranks by one all-to-all each: every rank then holds the whole sequence for 1/cp of the heads;
2. the model's own attention function (transformers' sdpa or eager) runs on them, with the mask of the whole
   sequence (causal; packed rows' documents kept apart; a sliding window where the layer has one);
3. one all-to-all turns its output back into this rank's part of the sequence, all heads.

Every other layer works on its tokens alone, so nothing else changes. The all-to-alls are torch's autograd ones
(their backward is the reverse all-to-all), on gloo and nccl alike.

It goes into a transformers model through its attention interface: the config's attn_implementation becomes
`launcher_ulysses|<the model's own>`, registered here for the attention and for the mask, so every attention
layer of the model calls it. Outside a split batch (the first batch's check, a forward on the whole sequence) it
is the model's own function and mask, unchanged.

Key/value heads (GQA) that cp does not divide are replicated before the all-to-all, each the fewest times that
make them split (up to one per query head), as Ulysses implementations do; query heads that cp does not divide
are refused."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from launcher.errors import UserError
from launcher.model import packed

NAME = packed.SPLIT  # registered as NAME|<the model's own implementation>
INNER = ("sdpa", "eager")  # the attention functions the split runs inside (their masks: packed.FORMS)


@dataclass
class Whole:
    """What the attention of a split batch needs of the whole sequence: the cp group, and the inputs of its mask."""

    group: Any
    size: int
    documents: Optional[torch.Tensor] = None  # [B, L] packed rows' sample of each token (-1: padding)
    valid: Optional[torch.Tensor] = None  # [B, L] a 2-D attention_mask's ones (real tokens) where there is one
    masks: Dict[Tuple[str, Optional[int]], Optional[torch.Tensor]] = field(default_factory=dict)  # built once a batch


_active: Optional[Whole] = None


@contextlib.contextmanager
def splitting(whole: Whole) -> Iterator[None]:
    """Around a split batch's forward and backward (recomputed activations run their attention again in backward)."""
    global _active
    before, _active = _active, whole
    try:
        yield
    finally:
        _active = before


def install(model: nn.Module, cp: int) -> List[str]:
    """Route every attention layer of `model` (a transformers model) through the split; UserError where it cannot
    be. Returns a line for the console."""
    config = getattr(model, "config", None)
    kind = type(model).__name__
    own = getattr(config, "_attn_implementation", None)
    if config is None or not hasattr(model, "loss_function") or not isinstance(own, str):
        raise UserError(f"parallel.cp: splits the attention of transformers' models through their attention "
                        f"interface, and the model ({kind}) is not one; set parallel.cp=1")
    if own.startswith(NAME):
        own = own.split("|", 1)[1]
    if own not in INNER:
        raise UserError(f"parallel.cp: the model ({kind}) uses attn_implementation '{own}', which the split does not "
                        f"run inside here ({' and '.join(INNER)} do); set model.attn_implementation: sdpa")
    if getattr(config, "is_encoder_decoder", False) or getattr(model.loss_function, "__name__", "") != "ForCausalLMLoss":
        raise UserError(f"parallel.cp: splits a causal language model's sequences (a transformers ...ForCausalLM), "
                        f"and {kind} is not one; set parallel.cp=1")
    layers = [(name, m) for name, m in model.named_modules() if hasattr(m, "num_key_value_groups")
              and hasattr(m, "head_dim")]
    if not layers:
        raise UserError(f"parallel.cp: found no attention layer in {kind} (a module with num_key_value_groups and "
                        f"head_dim, as transformers' attention modules have); set parallel.cp=1")
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or heads % cp:
        name, layer = layers[0]
        raise UserError(f"parallel.cp: {name} ({type(layer).__name__}) has {heads} attention heads, which do not "
                        f"split over cp={cp} ranks (Ulysses gives each rank whole heads); use a cp that divides "
                        f"{heads}")
    _register(own)
    config._attn_implementation = f"{NAME}|{own}"
    copies = replicas(heads, kv, cp)
    kept = (f"key/value heads replicated {copies} times each to split" if copies > 1 else
            f"{kv // cp} key/value head{'s' if kv // cp > 1 else ''}")
    return [f"parallel.cp: each sequence split along its length over {cp} ranks (Ulysses: {len(layers)} attention "
            f"layers, {own} inside, all-to-all from the sequence to the heads and back; {heads // cp} query heads a "
            f"rank, {kept}); a length cp does not divide is padded at the end to a multiple of {cp}"]


def replicas(heads: int, kv: int, cp: int) -> int:
    """How many copies of each key/value head make them split over cp: the fewest that divide the query heads'
    groups and make the count a multiple of cp."""
    groups = heads // kv
    return next(r for r in range(1, groups + 1) if groups % r == 0 and (kv * r) % cp == 0)


_registered: set = set()


def _register(own: str) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if own in _registered:
        return
    inner_mask = ALL_MASK_ATTENTION_FUNCTIONS[own]

    def attention(module, query, key, value, attention_mask, **kwargs):
        return _attention(own, module, query, key, value, attention_mask, **kwargs)

    def mask(*args, **kwargs):
        # a split batch's mask is the whole sequence's, built by the attention: the model's own of its part unused
        return None if _active is not None else inner_mask(*args, **kwargs)

    AttentionInterface.register(f"{NAME}|{own}", attention)
    AttentionMaskInterface.register(f"{NAME}|{own}", mask)
    _registered.add(own)


def _inner(own: str, module: nn.Module):
    if own == "eager":  # each model's own eager function, as its attention layer finds it
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[own]


class _Groups:
    """An attention module as the inner function sees it, with the query heads a key/value head serves after the
    replication (the function repeats each key/value head that many times)."""

    def __init__(self, module: nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _attention(own: str, module, query, key, value, attention_mask, **kwargs):
    inner = _inner(own, module)
    whole = _active
    if whole is None:  # not a split batch: the model's own attention
        return inner(module, query, key, value, attention_mask, **kwargs)
    cp, group = whole.size, whole.group
    heads, kv = query.shape[1], key.shape[1]
    copies = replicas(heads, kv, cp)
    if copies > 1:
        key, value = key.repeat_interleave(copies, dim=1), value.repeat_interleave(copies, dim=1)
    query, key, value = (_to_heads(t, cp, group) for t in (query, key, value))
    seen = _mask(whole, own, kwargs.get("sliding_window"), query.shape[2], query.device)
    out, _ = inner(_Groups(module, heads // (kv * copies)) if copies > 1 else module, query, key, value, seen, **kwargs)
    return _to_sequence(out, cp, group), None


def _to_heads(x: torch.Tensor, cp: int, group: Any) -> torch.Tensor:
    """[B, H, L/cp, D] of this rank's part of the sequence -> [B, H/cp, L, D]: the whole sequence, its heads."""
    b, h, part, d = x.shape
    chunks = x.reshape(b, cp, h // cp, part, d).transpose(0, 1).contiguous()  # [cp (to), B, H/cp, L/cp, D]
    got = _all_to_all(chunks, group)  # [cp (from: that part of the sequence), B, H/cp, L/cp, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * part, d)


def _to_sequence(y: torch.Tensor, cp: int, group: Any) -> torch.Tensor:
    """The attention's output [B, L, H/cp, D] -> [B, L/cp, H, D]: this rank's part of the sequence, every head."""
    b, length, h, d = y.shape
    part = length // cp
    chunks = y.reshape(b, cp, part, h, d).transpose(0, 1).contiguous()  # [cp (to: its part), B, L/cp, H/cp, D]
    got = _all_to_all(chunks, group)  # [cp (from: its heads), B, L/cp, H/cp, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, part, cp * h, d)


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x, None, None, group)  # equal parts along the first dimension


def _mask(whole: Whole, own: str, window: Optional[int], length: int, device: torch.device) -> Optional[torch.Tensor]:
    """The whole sequence's mask in the form `own` reads (packed.FORMS), built once a batch: None where sdpa's
    causal flag is the whole of it."""
    key = (own, window)
    if key in whole.masks:
        return whole.masks[key]
    if own == "sdpa" and whole.documents is None and whole.valid is None and window is None:
        whole.masks[key] = None
        return None
    index = torch.arange(length, device=device)
    sees = (index[None, :] <= index[:, None])[None]  # [1, L, L]: query, key
    if window is not None:
        sees = sees & (index[:, None] - index[None, :] < window)[None]
    if whole.documents is not None:
        docs = whole.documents.to(device)
        sees = sees & (docs[:, :, None] == docs[:, None, :])
    if whole.valid is not None:  # padding keys unseen; each token sees itself, so no row is empty (padding's rows
        sees = (sees & whole.valid.to(device=device, dtype=torch.bool)[:, None, :]) | torch.eye(  # are not scored)
            length, dtype=torch.bool, device=device)[None]
    sees = sees[:, None]  # [B, 1, L, L]
    if packed.FORMS[own] == "additive":
        sees = torch.zeros(sees.shape, dtype=torch.float32, device=device).masked_fill_(
            ~sees, torch.finfo(torch.float32).min)
    whole.masks[key] = sees
    return sees
