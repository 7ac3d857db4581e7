"""An HF model's tensors as its published folders hold them, and as the model holds them.

transformers 5 keeps a mixture of experts' weights fused: one 3-D parameter per layer and projection
(`mlp.experts.gate_up_proj`, [experts, 2 x intermediate, hidden]), where the folders people publish (and
`save_pretrained` writes) hold each expert's 2-D matrices (`mlp.experts.3.gate_proj.weight`, `up_proj`) and
sometimes other names (Mixtral's `block_sparse_moe.`). transformers converts between the two as it loads
and saves, by the model's conversion mapping. Here the same mapping is read, never re-written:

- `pieces(model)`: for each of the model's tensors whose published form differs, what the folder holds for it:
  each published tensor and the block of the model's tensor it is. Found by running transformers' own
  reversal (what save_pretrained does) on a probe, a small tensor of the model's tensor's positions along
  its first two dimensions: each published tensor's values say where it came from. A mapping that moves
  values across dimensions (Qwen3-VL-MoE's transposed experts) is not converted here: one line says so.
- `as_model(found, model)`: a folder's tensors keyed as the model's; a fused tensor is `Joined`, read an
  expert (a row of its first dimension) at a time, so that a rank reads only its shard's experts.
- `as_published(tensors, config)`: the model's tensors keyed as the folder transformers would write (export).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from launcher.errors import UserError

Block = Tuple[slice, ...]  # of a model's tensor: slices of its first one or two dimensions, the rest whole
Piece = Tuple[str, torch.Size, Block]  # a published tensor: its name, its shape, the block of the model's it is


def conversions(model: nn.Module) -> list:
    """The model's conversion mapping as save_pretrained reverses it (no legacy renames, no prefix changes), or
    [] for a model that is not a transformers model."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return []
    hf_model = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf_model is None:
        return []
    return [c for c in get_model_conversion_mapping(hf_model, add_legacy=False) if not isinstance(c, PrefixChange)]


def pieces(model: nn.Module, keys: Dict[str, torch.Size]) -> Dict[str, List[Piece]]:
    """For each of the model's tensors (`keys`: name -> shape; a peft model's: its base model's names) whose
    published name or form differs: its published pieces, in the order save_pretrained writes them."""
    found = conversions(model)
    if not found:
        return {}
    from transformers import PreTrainedModel
    from transformers.core_model_loading import WeightConverter, apply_converters

    config = next(m for m in model.modules() if isinstance(m, PreTrainedModel)).config
    revert = functools.partial(_reverted, found, config)
    converters = [c.reverse_transform() for c in found[::-1] if isinstance(c, WeightConverter)]
    out: Dict[str, List[Piece]] = {}
    for key, shape in keys.items():
        published = {n: t.shape for n, t in revert({key: torch.empty(shape, device="meta")}).items()}
        if apply_converters(key, converters)[1] is not None:  # its values moved, split or joined: probed
            out[key] = _blocks(key, shape, published, revert)
        elif published and published != {key: shape}:  # renamed alone
            out[key] = [(next(iter(published)), shape, ())]
    return out


def _reverted(found: list, config: Any, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers' save-time reversal of `state` by the conversions `found` (a converter's outputs are its
    input's: each key can be reverted alone)."""
    import types

    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(types.SimpleNamespace(_weight_conversions=found, config=config), state)


def _blocks(key: str, shape: torch.Size, published: Dict[str, torch.Size], revert) -> List[Piece]:
    """Where each published tensor of `key` lies in it, from transformers' reversal of a probe numbering the
    positions of its first dimension (and second, of a 3-D or larger tensor) and of the first two of each later
    one: a piece that is a block of whole rows keeps them in order; one made by moving values across the later
    dimensions (a transpose) does not, and is refused."""
    lead = tuple(shape[:2]) if len(shape) > 2 else tuple(shape[:1])
    later = tuple(shape[len(lead):])
    tail = tuple(min(size, 2) for size in later)
    probe = torch.arange(torch.Size(lead + tail).numel(), dtype=torch.int64).reshape(lead + tail)
    out = []
    for name, values in revert({key: probe}).items():
        block = _block(values, published.get(name), probe, later)
        if block is None:
            model_type = getattr(revert.args[1], "model_type", "this model")
            raise UserError(f"{key}: its published form ({name}) moves values across its dimensions (transformers' "
                            f"conversion mapping for {model_type}), which the launcher does not convert: name the "
                            f"folder in the recipe's model (its from_pretrained) rather than in checkpoint.init_from, "
                            f"and save what you train with save_pretrained")
        out.append((name, published[name], block))
    return out


def _block(values: torch.Tensor, shape: Optional[torch.Size], probe: torch.Tensor, later: tuple):
    """The block of the model's tensor (slices of its lead dimensions, the later ones whole) that a published
    tensor of `shape` is, from its probe `values`; None when it is no such block."""
    lead = probe.dim() - len(later)
    if shape is None or values.numel() == 0 or (later and tuple(shape[-len(later):]) != later):
        return None
    if later and tuple(values.shape[-len(later):]) != tuple(probe.shape[lead:]):
        return None
    rows = probe.reshape(probe.shape[:lead] + (-1,))[..., 0]  # each lead position's first probe value
    flat = values.reshape(-1)
    per = probe[(0,) * lead].numel()
    corners = [torch.nonzero(rows == int(v) // per * per)[0].tolist() for v in (flat.min(), flat.max())]
    block = tuple(slice(a, b + 1) for a, b in zip(*corners))
    covered = probe[block]
    rows_covered = covered[(Ellipsis,) + (0,) * len(later)].numel()
    if not torch.equal(flat, covered.reshape(-1)) or shape.numel() != rows_covered * torch.Size(later).numel():
        return None
    return block


class Joined:
    """A model's tensor made of a folder's published pieces (hf.Slice, each a block of it): `shape`, `dtype`, and
    `read(index)` or `tensor[index]`, which read only the pieces in the index's rows (a rank's experts)."""

    def __init__(self, shape: torch.Size, parts: List[Tuple[Any, Block]]):
        self.shape, self.parts = shape, parts
        self.dtype = parts[0][0].dtype

    def read(self, index: Tuple[slice, ...] = ()) -> torch.Tensor:
        start, stop, _ = (index[0] if index else slice(None)).indices(self.shape[0])
        out = torch.empty((stop - start,) + tuple(self.shape[1:]), dtype=self.dtype)
        for part, block in self.parts:
            rows = block[0]
            lo, hi = max(rows.start, start), min(rows.stop, stop)
            if lo >= hi:
                continue
            sizes = tuple(b.stop - b.start for b in block)
            piece = part.read().reshape(sizes + tuple(self.shape[len(block):]))
            out[(slice(lo - start, hi - start),) + block[1:]] = piece[lo - rows.start:hi - rows.start]
        return out[(slice(None),) + tuple(index[1:])] if len(index) > 1 else out

    def __getitem__(self, index) -> torch.Tensor:
        return self.read(index if isinstance(index, tuple) else (index,))


def as_model(found: Dict[str, Any], model: nn.Module, keys: Dict[str, torch.Size]) -> Dict[str, Any]:
    """A folder's tensors (name -> hf.Slice) keyed as the model's `keys` where the folder holds them published
    (per expert, or renamed); unchanged where it holds the model's own names already."""
    if all(k in found for k in keys):
        return found
    out = dict(found)
    for key, parts in pieces(model, keys).items():
        names = [name for name, _, _ in parts]
        if key in found or not all(n in found for n in names):
            continue
        taken = [(out.pop(n), block) for n, _, block in parts]
        out[key] = taken[0][0] if len(taken) == 1 else Joined(keys[key], taken)
    return out


def as_published(tensors, config: dict):
    """The model's tensors (hf.Tensors) keyed and split as save_pretrained writes them (its conversion mapping
    reversed): what `from_pretrained` and other tools read. Read a shard at a time, as `tensors` are."""
    model = _empty_model(config)
    if model is None:
        return tensors
    found = pieces(model, {k: shape for k, (shape, _) in tensors.specs.items()})
    if not found:
        return tensors
    sources: Dict[str, Tuple[str, Block]] = {}
    specs: Dict[str, Tuple[torch.Size, torch.dtype]] = {}
    for key, (shape, dtype) in tensors.specs.items():
        for name, piece_shape, block in found.get(key, [(key, shape, ())]):
            sources[name], specs[name] = (key, block), (piece_shape, dtype)

    def read(names: list) -> Dict[str, torch.Tensor]:
        got = tensors.read(sorted({sources[n][0] for n in names}))
        out = {}
        for n in names:
            key, block = sources[n]
            part = got[key][block].reshape(specs[n][0])
            out[n] = part.clone() if block else part  # its own memory: safetensors refuses views of one tensor
        return out

    return type(tensors)(specs, read)


def _empty_model(config: dict) -> Optional[nn.Module]:
    """The config's model built on the meta device (its module tree is what the conversion mapping reads), or
    None when transformers does not know it."""
    try:
        import transformers
    except ImportError:
        return None
    names = config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    model_type = config.get("model_type")
    if cls is None or not model_type:
        return None
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
        with torch.device("meta"):
            return cls(cfg)
    except (ValueError, TypeError, KeyError):  # a config transformers does not build: written as the model keys it
        return None
