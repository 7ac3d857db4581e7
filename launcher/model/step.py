"""The step: the one place that turns a batch into a loss, and the only code that knows the shape of
a batch or of a model's output.

Contract: `step(model, batch)` returns a scalar loss tensor (the mean over the batch's items), or a
mapping with `loss`, optionally `num_items` (how many items that mean is over, such as the labels that
are not -100), and `output` and `target` for the metrics. A step that counts its items makes the loop
weigh every item of an optimizer step alike, across micro-batches and ranks (token-weighted
accumulation).

Two steps ship. `Supervised` is `loss(model(input), target)` on `(input, target)` pairs. `ModelLoss`
is for models that compute their own loss, as HF Transformers models do: a mapping batch goes in as
`model(**batch)`, a tuple as `model(*batch)`, a tensor as `model(batch)`, and the loss is
`output.loss`, `output["loss"]` or the scalar output itself. Without a `step:` in the recipe, a recipe
with a `loss:` gets the first, one without gets the second.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional

import torch
from torch import nn

from launcher.model import chunked, packed
from launcher.model.plain import unwrap

IGNORE_INDEX = -100  # the label that is not a target (torch's CrossEntropyLoss and HF's convention)


class Result(NamedTuple):
    loss: torch.Tensor  # mean over the batch's items
    num_items: Optional[torch.Tensor]  # how many items the mean is over, when the step counts them
    output: Any  # what the metrics read as their first argument
    target: Any  # and as their second


class Supervised:
    """`loss(model(input), target)` on batches of `(input, target)` pairs."""

    def __init__(self, loss: Callable[[Any, Any], torch.Tensor]):
        self.loss = loss

    def __call__(self, model: nn.Module, batch: Any) -> Dict[str, Any]:
        x, y = batch
        output = model(x)
        return {"loss": self.loss(output, y), "output": output, "target": y}

    def fits(self, batch: Any) -> Optional[str]:
        """What is wrong with a batch for this step, or None."""
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return None
        what = f"a {type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        return (f"the recipe's loss takes (input, target) pairs, and a batch is {what}; without loss: the model "
                f"computes its own loss from model(**batch), model(*batch) or model(batch), or set step:")


class ModelLoss:
    """For a model that computes its own loss: `model(**batch)`, `model(*batch)` or `model(batch)`.

    A mapping batch passes only the keys the model's forward names (as HF Trainer does), so fields such
    as ids or strings stay in the batch for the metrics. When the model accepts HF's loss keywords and
    the batch has `labels`, the step counts the labels that are targets (after the causal shift, for a
    causal LM loss) and passes that count as `num_items_in_batch`, so the model's loss is a mean over
    exactly the items the step reports: accumulation is then token-weighted.

    A packed batch (its `document_ids` say which sample of a row each token is of) gets, in their place,
    the 4-D attention mask by which no token sees another sample, in the form the model's attention reads
    (launcher/model/packed.py); a model that cannot take one is a UserError.
    """

    def __init__(self, labels: str = "labels", ignore_index: int = IGNORE_INDEX):
        self.labels = labels
        self.ignore_index = ignore_index
        self._plan: Optional[tuple] = None  # per model: (argument names or None, counts items, shifts labels)
        self._mask: Optional[str] = None  # the form of attention mask the model reads (packed batches)
        self.left_out: List[str] = []  # batch keys the model's forward does not take

    def __call__(self, model: nn.Module, batch: Any) -> Dict[str, Any]:
        if isinstance(batch, Mapping):
            names, counts, shifts = self._plan or self._make_plan(model, batch)
            kwargs = dict(batch) if names is None else {k: v for k, v in batch.items() if k in names}
            if packed.KEY in batch:  # rows of several samples: none may see another
                self._mask = self._mask or packed.form(unwrap(model), names)
                kwargs.pop(packed.KEY, None)
                kwargs["attention_mask"] = packed.mask(batch[packed.KEY], self._mask)
            target = batch.get(self.labels)
            count = None
            if counts and isinstance(target, torch.Tensor):
                counted = batch.get("shift_labels", target[..., 1:] if shifts else target)
                count = (counted != self.ignore_index).sum()
                kwargs["num_items_in_batch"] = _per_replica(model, count.clamp(min=1))
            output = model(**kwargs)
            if chunked.hidden_only(output):  # trainer.loss_chunk: no logits were made, only the hidden states
                output["logits"] = None
        elif isinstance(batch, (tuple, list)):
            output, target, count = model(*batch), batch[-1] if len(batch) > 1 else None, None
        else:
            output, target, count = model(batch), None, None
        loss = own_loss(output)
        if isinstance(loss, torch.Tensor) and loss.dim() == 1:  # DataParallel: one loss per replica
            loss = loss.sum() if count is not None else loss.mean()
        result = {"loss": loss, "output": output, "target": target}
        if count is not None:
            result["num_items"] = count
        return result

    def _make_plan(self, model: nn.Module, batch: Mapping) -> tuple:
        plain = unwrap(model)
        parameters = _parameters(plain.forward)
        named = {n for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
        names = named if named else None  # forward(**batch): every key
        if names is not None and takes_any and hasattr(plain, "get_base_model"):
            # a peft model passes its **kwargs (position_ids among them) on to the model it adapts, whose
            # forward HF Trainer reads for the keys to keep
            names |= set(_parameters(plain.get_base_model().forward))
        if names is not None and takes_any:  # labels shifted by the batch (a sequence split: model/sequence.py),
            names |= {"shift_labels"}       # which transformers' causal LM loss takes in its **kwargs
        self.left_out = [k for k in batch if names is not None and k not in names and k != packed.KEY]
        # HF Trainer's rule: a model declares it, or a forward with **kwargs takes the loss keywords.
        counts = getattr(plain, "accepts_loss_kwargs", takes_any or "num_items_in_batch" in named)
        loss_fn = getattr(plain, "loss_function", None)
        config = getattr(plain, "config", None)
        shifts = getattr(loss_fn, "__name__", "") == "ForCausalLMLoss" and not getattr(config, "is_encoder_decoder", False)
        self._plan = (names, bool(counts) and self.labels in batch, shifts)
        return self._plan


def own_loss(output: Any) -> Any:
    """The loss a model returned: the output itself when it is a tensor, else `output["loss"]` or
    `output.loss` (an HF ModelOutput is both); None when there is none."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("loss")
    return getattr(output, "loss", None)


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the output itself, `output.logits` or `output["logits"]`."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output["logits"]
    return output.logits


def _per_replica(model: nn.Module, count: torch.Tensor) -> torch.Tensor:
    """DataParallel scatters tensors along their first dimension: one copy of the count per replica."""
    if isinstance(model, nn.DataParallel) and len(model.device_ids) > 1:
        return count.reshape(1).expand(len(model.device_ids))
    return count


def _parameters(fn: Callable) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def result(value: Any) -> Result:
    """A step's return value, as the loop reads it."""
    if isinstance(value, Mapping):
        return Result(value["loss"], value.get("num_items"), value.get("output"), value.get("target"))
    return Result(value, None, None, None)


def select(loss: Optional[Callable]) -> Callable:
    """The step for a recipe without one: the supervised step when there is a loss, else the model's own loss."""
    return Supervised(loss) if loss is not None else ModelLoss()


def items_in(batch: Any) -> int:
    """How many items a batch holds: the first dimension of its first tensor (known on the host)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        batch = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for value in values:
        n = items_in(value)
        if n:
            return n
    return 0
