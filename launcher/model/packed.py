"""Packed rows in the model: the attention mask that keeps each sample of a row to itself, in the form
the model's attention reads, and the check at start that it does.

A packed batch (launcher/data/text/packing.py, collated by `launcher.data.collate.Packed`) carries
`document_ids` [batch, length]: which sample of its row each token belongs to, -1 for padding, beside
`position_ids` that restart at 0 at each sample. The step (launcher/model/step.py) passes the model a
4-D `attention_mask` [batch, 1, length, length] instead: token q sees token k when k <= q and both are of
one sample. It is built on the device, from the small `document_ids`, with no host read.

transformers (5.x) hands a 4-D mask to the attention as it is, and its attention implementations read it
differently: sdpa as torch's `scaled_dot_product_attention` does (bool: True attends), eager by adding it
to the scores (a bool mask there would add 1 and let every token see every earlier one). So sdpa gets a
bool mask and eager an additive one (0, or float32's least value, which bf16 and fp16 scores take too).
Others (flash_attention_2/3 read boundaries from position_ids or cu_seq_lens, flex_attention a BlockMask)
are refused with one line: untested here. A model that is not from transformers gets the bool mask, and
the first batch's check (`crossing`) finds out whether it honours it. An MoE model that computes its router's
load-balancing loss (`output_router_logits`) is refused too: transformers weighs that loss by the attention mask
flattened to one flag a token, which a 4-D mask is not.
"""

from __future__ import annotations

from typing import Callable, Collection, Mapping, Optional

import torch
from torch import nn

from launcher.errors import UserError

KEY = "document_ids"  # the batch key that marks a packed batch and holds its boundaries
FORMS = {"sdpa": "bool", "eager": "additive"}  # transformers' attn_implementation -> the 4-D mask it reads
SPLIT = "launcher_ulysses"  # parallel.cp's attention around the model's own, registered as SPLIT|<own> (parallel/ulysses.py)


def form(model: nn.Module, names: Optional[Collection[str]]) -> str:
    """The form of mask `model` (unwrapped) reads, or UserError when it cannot keep packed samples apart;
    `names`: the arguments of its forward (None: it takes any keyword)."""
    kind = type(model).__name__
    missing = [n for n in ("attention_mask", "position_ids") if names is not None and n not in names]
    if missing:
        raise UserError(f"data.train: packed rows need a model whose forward takes attention_mask (a 4-D mask) and "
                        f"position_ids, and {kind}.forward takes no {' or '.join(missing)}; set data.train.packing: "
                        f"false")
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False) is True:
        # transformers' MoE models weigh their load-balancing loss by the attention mask read as one flag a token
        raise UserError(f"data.train: packed rows give {kind} a 4-D attention mask, and its router's load-balancing "
                        f"loss (model.config.output_router_logits: true) reads a 2-D one, a flag a token; set "
                        f"data.train.packing: false, or model.config.output_router_logits: false")
    implementation = getattr(config, "_attn_implementation", None) if config is not None else None
    if isinstance(implementation, str) and implementation.startswith(SPLIT + "|"):  # outside a split: the model's own
        implementation = implementation.split("|", 1)[1]
    if implementation is None:
        return "bool"
    if implementation not in FORMS:
        raise UserError(f"model: {kind} uses attn_implementation '{implementation}', to which packed rows give no "
                        f"sample boundaries here ({' and '.join(FORMS)} take them); set model.attn_implementation: "
                        f"sdpa, or data.train.packing: false")
    return FORMS[implementation]


def mask(document_ids: torch.Tensor, how: str) -> torch.Tensor:
    """The [batch, 1, length, length] mask by which a token sees the earlier tokens of its own sample."""
    length = document_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril_()
    sees = (document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)) & causal
    sees = sees.unsqueeze(1)
    if how == "bool":
        return sees
    additive = torch.zeros(sees.shape, dtype=torch.float32, device=sees.device)
    return additive.masked_fill_(~sees, torch.finfo(torch.float32).min)


def crossing(loss_of: Callable[[Mapping], torch.Tensor], batch: Mapping, labels: str = "labels") -> Optional[str]:
    """Whether samples of a packed batch see each other, found by two forwards (`loss_of(batch)`, without
    gradients): the loss on every sample but the first of each row, then again with the first samples'
    tokens changed. Where the mask holds, the second loss is the first (the same kernels on the same scores,
    the changed tokens weighted by exact zeros); a leak changes it. None when they do not."""
    first = batch[KEY] == 0
    ids = batch["input_ids"]
    other = torch.where(ids == ids.max(), ids.min(), ids.max())  # ids the batch holds: in the vocabulary
    scored = {**batch, labels: batch[labels].masked_fill(first, -100)}
    changed = {**scored, "input_ids": torch.where(first, other, ids)}
    with torch.no_grad():
        before, after = loss_of(scored).float(), loss_of(changed).float()
    if torch.isclose(before, after, rtol=1e-4, atol=0.0):  # host sync: once, before training
        return None
    return (f"the model lets packed samples attend to each other: changing the first sample of each row changes the "
            f"loss of the others from {before.item():.6g} to {after.item():.6g}")
