"""The limit for the HF row: the loop an HF user writes by hand for recipes/hf_causal_lm.yaml. The
same GPT2LMHeadModel from the same GPT2Config, the same Passages and Pad collate, AdamW with the same
arguments, all read from the recipe file itself so that the two sides cannot drift; one thread;
`loss = model(**batch).loss`, the loss summed on the device and read every 100 steps (as raw.py).

The sample order is the launcher's (DistributedSampler's permutation of seed + epoch, here for one
process), so that both sides pad the same batches to the same lengths: the work per step is the same,
step for step, and only the loops around it differ.

    python -m launcher.bench.loop.raw_hf [STEPS]
"""

import sys
from pathlib import Path

import torch
import yaml

from launcher.bench.workload import StepClock, finish
from launcher.data.collate import Pad
from recipes.components.passages import Passages

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "hf_causal_lm.yaml"
READ_EVERY = 100
# What this loop builds, by hand, for each section it reads: a recipe that names something else is
# no longer the workload this loop reproduces.
BUILDS = {"model": "transformers.GPT2LMHeadModel", "model.config": "transformers.GPT2Config",
          "optimizer": "torch.optim.AdamW", "data.train": "recipes.components.passages.Passages",
          "data.collate": "launcher.data.collate.Pad"}


def arguments(recipe: dict, key: str) -> dict:
    """The constructor arguments of the recipe's `key` (dotted), checked to build what BUILDS says."""
    spec = recipe
    for part in key.split("."):
        spec = spec[part]
    if spec.get("_target_") != BUILDS[key]:
        raise SystemExit(f"{RECIPE}: {key} builds {spec.get('_target_')}, and raw_hf.py builds {BUILDS[key]}; "
                         f"change them together")
    return {k: v for k, v in spec.items() if k != "_target_"}


def main(argv: list) -> None:
    steps = int(argv[0]) if argv else 200
    from transformers import GPT2Config, GPT2LMHeadModel  # the benchmark runs this only when installed

    torch.set_num_threads(1)
    recipe = yaml.safe_load(RECIPE.read_text())
    seed, batch_size = recipe["seed"], recipe["data"]["batch_size"]
    data = Passages(**arguments(recipe, "data.train"))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed,
                                                  drop_last=True)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True,
                                         collate_fn=Pad(**arguments(recipe, "data.collate")))
    torch.manual_seed(seed)  # what the launcher's seed: does before it builds the model
    others = {k: v for k, v in arguments(recipe, "model").items() if k != "config"}
    model = GPT2LMHeadModel(GPT2Config(**arguments(recipe, "model.config")), **others)
    optimizer = torch.optim.AdamW(model.parameters(), **arguments(recipe, "optimizer"))
    model.train()
    clock, step, epoch, since_read = StepClock(), 0, 0, 0
    total, mean = torch.zeros(()), float("nan")
    while step < steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for batch in loader:
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            step, since_read = step + 1, since_read + 1
            clock.tick()
            if step % READ_EVERY == 0 or step == steps:
                mean = (total / since_read).item()  # host sync: once per 100 steps
                total.zero_()
                since_read = 0
            if step >= steps:
                break
    clock.report(loss=mean)


if __name__ == "__main__":
    main(sys.argv[1:])
    finish()
