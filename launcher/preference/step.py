"""`DPO`: the preference step. A recipe names it (`step: {_target_: launcher.preference.DPO, beta: 0.1}`) over a
preference dataset (launcher/data/text, format `preference`, collated by `launcher.data.collate.Pairs`).

Each pair's chosen and rejected answers go through the model in one forward: as rows of their own (rows 2p and
2p + 1) or as documents of packed rows, which the same 4-D mask as SFT's packing keeps apart
(launcher/model/packed.py). The log-probabilities of the answer tokens only (the labels that are not -100) are
summed per answer (logps.py) and the loss taken per pair (losses.py), its mean over the batch's pairs: the step
counts pairs (`num_items`), so accumulation and ranks weigh every pair alike.

The reference's log-probabilities are not computed here: the run computes them once before training
(launcher/run/reference.py) and the batch carries them per token (`ref_logps`), summed per answer exactly as
the policy's are. No rank holds a second model.

What is logged is what TRL's DPOTrainer logs, under the same names: rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies, logps/chosen, logps/rejected (means over pairs). An MoE model's own
auxiliary loss is added as its config weighs it (router_aux_loss_coef), where the model returns one."""

from __future__ import annotations

import inspect
import math
from typing import Any, Dict, Mapping, Optional

import torch
from torch import nn

from launcher.errors import UserError
from launcher.model import packed
from launcher.model.plain import unwrap
from launcher.model.step import logits_of
from launcher.preference import logps, losses

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


class Field:
    """A metric that reads one of the step's per-pair values (NaN where a batch's pair slot is empty)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, output: Mapping[str, torch.Tensor], target: Any) -> torch.Tensor:
        return output[self.name]


class DPO:
    """beta: the strength of the reference's pull (DPO's β; SimPO's reward scale)
    loss_type: sigmoid (DPO) | ipo | simpo (reference-free)
    label_smoothing: the share of pairs assumed mislabelled (cDPO's ε; sigmoid and simpo)
    gamma: SimPO's target margin γ (TRL's simpo_gamma)"""

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 gamma: float = 0.5):
        if loss_type not in losses.LOSSES:
            raise ValueError(f"loss_type: {loss_type!r} is not one of {', '.join(losses.LOSSES)}")
        for name, value in (("beta", beta), ("label_smoothing", label_smoothing), ("gamma", gamma)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}: {value!r} is not a number")
        if beta <= 0:
            raise ValueError(f"beta: {beta}: a number above 0")
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing: {label_smoothing}: a share in [0, 0.5)")
        if label_smoothing and loss_type == "ipo":
            raise ValueError("label_smoothing: ipo takes none (sigmoid and simpo do)")
        self.beta, self.loss_type, self.label_smoothing, self.gamma = float(beta), loss_type, float(label_smoothing), float(gamma)
        self.needs_reference = losses.needs_reference(loss_type)
        self.metrics = {name: Field(name) for name in METRICS}  # the loop logs them beside the recipe's own
        self._names: Optional[set] = None
        self._mask: Optional[str] = None

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> Dict[str, Any]:
        if not isinstance(batch, Mapping) or "sequence_ids" not in batch:
            raise UserError("step: launcher.preference.DPO reads batches of preference pairs (data.train with format: "
                            "preference, collated by launcher.data.collate.Pairs)")
        output = model(**self.inputs(model, batch))
        labels, ids = batch["labels"], batch["sequence_ids"]
        count = logps.sequences(batch)
        sums, tokens = logps.summed(logps.per_token(logits_of(output), labels), labels, ids, count)
        chosen, rejected = logps.pairs(sums)
        chosen_tokens, rejected_tokens = logps.pairs(tokens)
        ref_chosen = ref_rejected = torch.zeros_like(chosen)
        if self.needs_reference:
            if "ref_logps" not in batch:
                raise UserError(f"step.loss_type: {self.loss_type} needs the reference's log-probabilities, and the "
                                f"batches carry none: the run computes them for a map-style preference dataset "
                                f"(data.train: TextDataset with format: preference); or set step.loss_type: simpo "
                                f"(reference-free)")
            ref, _ = logps.summed(batch["ref_logps"].to(sums.dtype), labels, ids, count)
            ref_chosen, ref_rejected = logps.pairs(ref)
        per = losses.per_pair(self.loss_type, self.beta, self.label_smoothing, self.gamma, chosen, rejected,
                              ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)
        held = (chosen_tokens > 0) & (rejected_tokens > 0)  # the batch's pair slots that hold a pair
        held_count = held.sum()
        loss = torch.where(held, per["loss"], 0.0).sum() / held_count.clamp(min=1)
        loss = loss + self._aux(model, output)
        return {"loss": loss, "num_items": held_count, "output": _logged(per, chosen, rejected, held), "target": None}

    def inputs(self, model: nn.Module, batch: Mapping[str, Any]) -> Dict[str, Any]:
        """The model's arguments: the rows, and their attention mask (packed rows: the 4-D mask that keeps each
        answer to itself and its prompt, and position ids restarting at each)."""
        plain = unwrap(model)
        if self._names is None:
            parameters = inspect.signature(plain.forward).parameters
            self._names = None if any(p.kind == p.VAR_KEYWORD for p in parameters.values()) else set(parameters)
        kwargs = {"input_ids": batch["input_ids"]}
        if packed.KEY in batch:
            self._mask = self._mask or packed.form(plain, self._names)
            kwargs["attention_mask"] = packed.mask(batch[packed.KEY], self._mask)
            kwargs["position_ids"] = batch["position_ids"]
        else:
            kwargs["attention_mask"] = batch["attention_mask"]
        if self._names is None or "use_cache" in self._names:
            kwargs["use_cache"] = False
        return kwargs

    def _aux(self, model: nn.Module, output: Any) -> Any:
        aux = getattr(output, "aux_loss", None)
        config = getattr(unwrap(model), "config", None)
        if aux is None or not getattr(config, "output_router_logits", False):
            return 0.0
        return getattr(config, "router_aux_loss_coef", 0.0) * aux


def _logged(per: Dict[str, torch.Tensor], chosen: torch.Tensor, rejected: torch.Tensor,
            held: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The per-pair values TRL logs, NaN at empty pair slots (the meter's mean leaves NaN out)."""
    good, bad = per["chosen_rewards"], per["rejected_rewards"]
    values = {"rewards/chosen": good, "rewards/rejected": bad, "rewards/margins": good - bad,
              "rewards/accuracies": (good > bad).to(good.dtype), "logps/chosen": chosen.detach(),
              "logps/rejected": rejected.detach()}
    return {name: torch.where(held, value, float("nan")) for name, value in values.items()}
