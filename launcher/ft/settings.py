"""What a group is, read from its recipe and environment; pure functions, torchft not imported.

- Its index: `fault_tolerance.group`, else `REPLICA_GROUP_ID` (the variable torchtitan and torchft's examples
  read, which python -m launcher.ft and the Slurm jobs of python -m launcher.slurm set), else a Kubernetes
  JobSet pod's job index (kubernetes.py).
- The lighthouse: `fault_tolerance.lighthouse`, else `TORCHFT_LIGHTHOUSE` (torchft's variable).
- Its share of each global batch: group g of N, whose W processes read ranks g*W .. g*W+W-1 of N*W. A group
  always reads its own share, so a step's items are a function of (seed, step) and of which groups were live
  at that step: a down group's share is not trained that step, and the gradient is the mean over the live
  groups' items (exactly the ddp x N gradient when every group is live).
- Its checkpoints: `<checkpoint.dir>/group_<g>` where checkpoint.dir names a place outside its run folder (an
  object store's prefix, another folder): the groups share one recipe, and so one checkpoint.dir, whose lock would
  refuse all but one of them.
- Its fingerprint: the recipe's keys that shape what a step trains, which a group hands to one that joins;
  the one that joins refuses a run whose fingerprint differs from its own, before anything of it is averaged.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from launcher.errors import UserError, short
from launcher.ft import kubernetes
from launcher.recipe.fault_tolerance import FaultToleranceConfig, lighthouse_problem
from launcher.recipe.flat import flatten

GROUP_VARIABLE = "REPLICA_GROUP_ID"
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"

# The recipe keys (and every key under them) that decide what a step trains: groups that differ in one of them
# would average gradients of different models, data or schedules. Where a run writes, how it logs and how long it
# waits are not among them.
TRAINING_KEYS = ("seed", "precision", "model", "loss", "step", "optimizer", "lr_schedule", "data.train",
                 "data.batch_size", "data.shuffle", "data.collate", "trainer.max_steps", "trainer.max_epochs",
                 "trainer.grad_accum_steps", "trainer.clip_grad_norm", "fault_tolerance.groups", "parallel.tp_plan",
                 "fsdp.reduce_dtype")
PROCESSES = "processes per group"  # not a key: each group's share of a batch depends on it too
LAYOUT = "model per process"  # nor this: how each process holds the model (whole, or its shards of a mesh)


def group_index(section: FaultToleranceConfig, env: Mapping[str, str]) -> int:
    """This group's index: the key wins over the environment."""
    if section.group is not None:
        return section.group
    raw = env.get(GROUP_VARIABLE)
    if raw is None and kubernetes.INDEX in env:
        return kubernetes.group(env, section.groups)
    if raw is None:
        raise UserError(f"fault_tolerance.group: not set, and {GROUP_VARIABLE} is not in the environment; set "
                        f"fault_tolerance.group=<0 to {section.groups - 1}>, or start the groups with python -m "
                        f"launcher.ft, which gives each its own")
    if not re.fullmatch(r"\d+", raw.strip()) or int(raw) >= section.groups:
        raise UserError(f"environment variable {GROUP_VARIABLE}={short(raw)} is not a group index of "
                        f"fault_tolerance.groups={section.groups}: 0 to {section.groups - 1}")
    return int(raw)


def lighthouse_address(section: FaultToleranceConfig, env: Mapping[str, str]) -> str:
    """The lighthouse's http://host:port: the key wins over the environment."""
    if section.lighthouse is not None:
        return section.lighthouse
    raw = env.get(LIGHTHOUSE_VARIABLE)
    if not raw:
        raise UserError(f"fault_tolerance.lighthouse: not set, and {LIGHTHOUSE_VARIABLE} is not in the environment; "
                        f"set fault_tolerance.lighthouse=http://host:port (the lighthouse's), or start the groups with "
                        f"python -m launcher.ft, which starts a lighthouse and gives its address")
    wrong = lighthouse_problem(raw)
    if wrong:
        raise UserError(f"environment variable {LIGHTHOUSE_VARIABLE}={short(raw)}: {wrong}")
    return raw


def checkpoints_of(configured: Optional[str], group: int, run_dir: str) -> Optional[str]:
    """Where group `group` keeps its checkpoints, from the recipe's checkpoint.dir: a place of its own below it,
    unless it is inside the group's run folder (its own already) or not set (<run_dir>/checkpoints)."""
    if not configured:
        return configured
    if "://" not in configured and Path(configured).resolve().is_relative_to(Path(run_dir).resolve()):
        return configured
    return f"{configured.rstrip('/')}/group_{group}"


def share(group: int, groups: int, inside: Tuple[int, int]) -> Tuple[int, int]:
    """(how many ranks of the whole run read their own share of a batch, this rank's place among them), from
    this group's index and the (count, place) inside the group."""
    count, place = inside
    return count * groups, group * count + place


def fingerprint(recipe: Any, processes: int, layout: str = "whole") -> Dict[str, Any]:
    """The recipe's training keys, flattened (`model.hidden: 128`), with the group's process count and how each of
    its processes holds the model (the strategy's `layout()`: rank r of every group must hold the same shards)."""
    flat = flatten(recipe)
    kept = {k: v for k, v in flat.items() if any(k == key or k.startswith(key + ".") for key in TRAINING_KEYS)}
    return {**kept, PROCESSES: processes, LAYOUT: layout}


def differences(mine: Mapping[str, Any], theirs: Mapping[str, Any], there: str = "in the live groups") -> List[str]:
    """`key (here -> there)` for each training key the two recipes do not share."""
    return [f"{k} ({short(mine.get(k))} here, {short(theirs.get(k))} {there})"
            for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]


def refused(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> Optional[str]:
    """The line a group whose fingerprint is `mine` stops with where the live groups' is `theirs`, or None."""
    if dict(mine) == dict(theirs):
        return None
    changed = differences(mine, theirs)
    return (f"fault_tolerance: this group's recipe differs from the live groups' in {'; '.join(changed[:4])}"
            f"{' and more' if len(changed) > 4 else ''}; a group joins only a run of the same recipe, and this one was "
            f"not averaged in")
