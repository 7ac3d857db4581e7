"""The DPO family's losses, per pair, from the answers' summed log-probabilities (and their token counts).

With π the policy's and ρ the reference's log-probability of an answer (summed over its tokens), c chosen and
r rejected, and Δ = (π_c - ρ_c) - (π_r - ρ_r):

- `sigmoid` (DPO, Rafailov et al. 2023; with label smoothing ε, the conservative cDPO):
  -(1 - ε) log σ(βΔ) - ε log σ(-βΔ). TRL's `sigmoid` is ε = 0.
- `ipo` (Azar et al. 2023): (Δ' - 1/(2β))², Δ' the same difference of log-ratios with each answer's divided
  by its token count, as TRL computes it (which its authors confirmed to TRL as the paper's form).
- `simpo` (Meng et al. 2024), reference-free: -(1 - ε) log σ(βD - γ) - ε log σ(-(βD - γ)), D the difference
  of the answers' mean log-probabilities per token, γ the target margin (`gamma`); as TRL's CPOTrainer with
  loss_type simpo and cpo_alpha 0.

The rewards are TRL's: β(π - ρ) for the reference's losses, β times the mean log-probability per token for
SimPO; accuracies are the pairs whose chosen reward is above the rejected one's."""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)


def needs_reference(loss_type: str) -> bool:
    return loss_type not in REFERENCE_FREE


def per_pair(loss_type: str, beta: float, label_smoothing: float, gamma: float, chosen: torch.Tensor,
             rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
    """{"loss": per pair, "chosen_rewards", "rejected_rewards"}: tensors [pairs]. The ref_* are ignored by a
    reference-free loss (they may be zeros)."""
    if loss_type == "simpo":
        mean_chosen = chosen / chosen_tokens.clamp(min=1)
        mean_rejected = rejected / rejected_tokens.clamp(min=1)
        z = beta * (mean_chosen - mean_rejected) - gamma
        loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
        return {"loss": loss, "chosen_rewards": beta * mean_chosen.detach(),
                "rejected_rewards": beta * mean_rejected.detach()}
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if loss_type == "sigmoid":
        z = beta * (chosen_ratio - rejected_ratio)
        loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    elif loss_type == "ipo":
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        loss = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type: {loss_type!r} is not one of {', '.join(LOSSES)}")
    return {"loss": loss, "chosen_rewards": beta * chosen_ratio.detach(),
            "rejected_rewards": beta * rejected_ratio.detach()}
