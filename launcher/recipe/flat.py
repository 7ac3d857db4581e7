"""Recipes as flat `dotted.key: value` mappings: for TensorBoard's hparams and for comparing recipes."""

from __future__ import annotations

from typing import Any, Dict, List

from omegaconf import DictConfig, OmegaConf

from launcher.errors import shown

# Where a run writes and how it shows itself: changing these does not change what it trains.
_NOT_TRAINING = {"run_dir", "checkpoint.resume", "checkpoint.init_from", "checkpoint.every", "checkpoint.keep",
                 "checkpoint.dir", "trainer.log_every", "trainer.eval_every"}


def flatten(node: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        out: Dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def hparams(config: DictConfig) -> Dict[str, Any]:
    """Scalar values, with `model._target_` shown as `model`."""
    return {key.replace("._target_", ""): value for key, value in flatten(config).items()
            if isinstance(value, (bool, int, float, str))}


def differences(saved: DictConfig, current: DictConfig) -> List[str]:
    """`key (old -> new)` for every training-relevant value that differs. The saved recipe is a checkpoint's
    text: its keys and values are shown escaped."""
    a, b = flatten(saved), flatten(current)
    return [f"{shown(k, 80)} ({shown(a.get(k), 80)} -> {shown(b.get(k), 80)})" for k in sorted(set(a) | set(b))
            if k not in _NOT_TRAINING and not k.startswith("logging.") and a.get(k) != b.get(k)]
