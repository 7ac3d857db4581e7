"""Preference tuning: the DPO family of losses on pairs of answers (launcher/data/text's `preference` format).

    logps.py   the answer tokens' log-probabilities, per token and summed per sequence of a batch
    losses.py  the losses (sigmoid DPO, IPO, SimPO) and the rewards TRL logs, from those sums
    step.py    `DPO`, the step a recipe names (`step: {_target_: launcher.preference.DPO}`): chosen and
               rejected in one forward, the reference's log-probabilities read from the batch

The reference's log-probabilities are computed once, before training, by the run (launcher/run/reference.py)
and kept with the samples, so that no rank holds a second model."""

from launcher.preference.step import DPO

__all__ = ["DPO"]
