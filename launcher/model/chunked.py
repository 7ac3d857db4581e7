"""The loss in chunks along the sequence (`trainer.loss_chunk`): a transformers causal LM's output layer and
cross-entropy computed a chunk of tokens at a time, so that no whole `tokens x vocab` logits tensor is made, in
forward or in backward (with a 150k vocabulary it is the largest tensor of a long-sequence step).

The model's own forward still runs, through every wrapper (DDP, FSDP2's root, DataParallel's replicas), and
still calls its own loss function with the labels, `num_items_in_batch` and `shift_labels` the step gives it
(launcher/model/step.py, launcher/model/sequence.py under parallel.cp: each rank chunks its own part). Two
swaps on the model make it so, neither of which changes its state_dict keys: the output layer's class becomes
a subclass that returns its input, the hidden states, tagged with the layer itself (its weight, tied to the
embedding or not, is read at the loss, where FSDP has it gathered; a replica's is the replica's own); and the
model's `loss_function` becomes one that, like transformers' ForCausalLMLoss, shifts the labels, upcasts the
logits to float32 (a float64 model's stay float64) and sums the cross-entropy over the targets (divided by
`num_items_in_batch`, else by their count), but a chunk at a time, each under torch.utils.checkpoint: its logits
are made again in backward, one chunk's at a time. The sums are the same; only their order differs (rounding).
The output's `logits` are None (the step clears the hidden states from there): metrics get no logits."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from launcher.errors import UserError
from launcher.model.plain import unwrap

KEY = "trainer.loss_chunk"
TAG = "_launcher_head"  # on the hidden states the output layer returns: the layer whose weight makes the logits


def install(model: nn.Module, tokens: int) -> str:
    """Make `model` compute its loss `tokens` at a time; returns the console's line. A model this cannot do
    is a UserError naming the key and its class."""
    plain = unwrap(model)
    if hasattr(plain, "get_base_model"):  # a peft model: the model it adapts computes the logits and the loss
        plain = plain.get_base_model()
    name = type(plain).__name__
    head = plain.get_output_embeddings() if hasattr(plain, "get_output_embeddings") else None
    loss_fn = getattr(plain, "loss_function", None) if hasattr(plain, "config") else None
    why = None
    if not isinstance(head, nn.Linear) or getattr(loss_fn, "__name__", "") != "ForCausalLMLoss":
        why = ("is not a transformers causal LM (an output layer nn.Linear, not adapted by LoRA, and transformers' "
               "ForCausalLMLoss)")
    elif getattr(plain.config, "is_encoder_decoder", False):
        why = "is an encoder-decoder model"
    elif getattr(plain.config, "final_logit_softcapping", None) is not None:
        why = "caps its logits (config.final_logit_softcapping), which the chunks do not apply yet"
    if why:
        raise UserError(f"{KEY}: {name} {why}; the loss in chunks is for transformers' causal LMs (Llama, Qwen2/3, "
                        f"Mistral, Gemma, Qwen3-MoE); set {KEY}=null")
    head.__class__ = _returning_hidden(type(head))
    plain.loss_function = _in_chunks(tokens)
    return (f"{KEY}: {name}'s output layer and loss computed {tokens} tokens at a time, each chunk's logits "
            f"({tokens} x {head.out_features}) made again in backward: no whole logits tensor")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = -100,
                   shift_labels: Optional[torch.Tensor] = None, *, tokens: int, **kwargs: Any) -> torch.Tensor:
    """transformers' ForCausalLMLoss, given the hidden states (tagged with the output layer) for the logits."""
    head = getattr(logits, TAG, None)
    if head is None:  # something between the output layer and the loss made a new tensor (a bug: install checks)
        raise RuntimeError(f"{KEY}: the loss was given a tensor the output layer did not return")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = logits.reshape(-1, logits.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    total = hidden.new_zeros((), dtype=_widest(hidden.dtype))
    for start in range(0, hidden.shape[0], tokens):
        end = start + tokens
        total = total + checkpoint(_chunk, hidden[start:end], targets[start:end], head.weight, head.bias,
                                   ignore_index, use_reentrant=False)
    if num_items_in_batch is None:  # cross_entropy's mean: over the targets (nan when there is none, as it)
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunk(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(_widest(logits.dtype))
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def _widest(dtype: torch.dtype) -> torch.dtype:
    # transformers' .float(): bf16 and fp16 logits upcast to float32 for the loss; a float64 model's stay float64
    return torch.promote_types(dtype, torch.float32)


def hidden_only(output: Any) -> bool:
    """Whether a model's output holds the hidden states where its logits would be (the loss was chunked)."""
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    return isinstance(logits, torch.Tensor) and getattr(logits, TAG, None) is not None


def _in_chunks(tokens: int):
    def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        return causal_lm_loss(*args, tokens=tokens, **kwargs)

    # named as transformers' own: the step (which counts shifted labels) and parallel.cp read the name
    loss.__name__ = loss.__qualname__ = "ForCausalLMLoss"
    return loss


@functools.lru_cache(maxsize=None)
def _returning_hidden(cls: type) -> type:
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden.view(hidden.shape)  # a tensor of its own to tag, sharing the hidden states' memory
        setattr(out, TAG, self)
        return out

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
