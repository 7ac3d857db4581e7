"""How far apart a model's weights end under two processes and under one, per parameter: the measurement
behind docs/launching.md's tolerance claims (tests/test_hf_tolerance.py tests them).

    python -m tests.hf_tolerance bert,gpt2,t5,vit sgd,adamw,adamw-eps1e-5 --steps 30
    python -m tests.hf_tolerance t5 sgd,adamw --steps 30 model.feed_forward_proj=gated-gelu

prints, for each model, optimizer and strategy (ddp x2, fsdp x2), the parameters outside rtol 1e-5,
atol 1e-6 of one process's, the largest difference, and both final losses."""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from tests.pace import paced

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "tests" / "hf_zoo.yaml"
OPTIMIZERS = {
    "sgd": ["optimizer._target_=torch.optim.SGD", "optimizer.lr=0.1"],
    "adamw": [],  # torch's defaults: eps 1e-8
    "adamw-eps1e-5": ["optimizer.eps=1e-5"],
}
IMAGES = ["data.train._target_=tests.hf_zoo.Images", "data.collate=null"]
# Megatron's plan written for a model that carries none (BERT and ViT in transformers 5 do not): the attention's
# query, key and value split by heads, its output rowwise; the MLP's first layer colwise, its second rowwise.
TP_PLANS = {
    "bert": "{'bert.encoder.layer.*.attention.self.query': colwise, 'bert.encoder.layer.*.attention.self.key': colwise, "
            "'bert.encoder.layer.*.attention.self.value': colwise, 'bert.encoder.layer.*.attention.output.dense': "
            "rowwise, 'bert.encoder.layer.*.intermediate.dense': colwise, 'bert.encoder.layer.*.output.dense': rowwise}",
}


def overrides(model: str, optimizer: str, steps: int = 6) -> List[str]:
    return [f"model._target_=tests.hf_zoo.{model}", *OPTIMIZERS[optimizer], *(IMAGES if model == "vit" else []),
            f"trainer.max_steps={steps}", f"trainer.log_every={steps}"]


def launch(run_dir: Path, args: List[str], strategy: str = "single", timeout: float = 300) -> subprocess.CompletedProcess:
    """Train in a fresh `python -m launcher`: one process, or two under ddp, fsdp or tp (fsdp's mesh, tp 2)."""
    procs = [] if strategy == "single" else [f"strategy={strategy}", "nproc_per_node=2"]
    if strategy == "tp":
        model = next(a.rsplit(".", 1)[1] for a in args if a.startswith("model._target_=tests.hf_zoo."))
        procs = ["strategy=fsdp", "parallel.tp=2", f"parallel.tp_plan={TP_PLANS[model]}", "nproc_per_node=2"]
    done = subprocess.run([sys.executable, "-m", "launcher", str(RECIPE), f"run_dir={run_dir}", *args, *procs],
                          cwd=REPO, capture_output=True, text=True, timeout=paced(timeout))
    assert done.returncode == 0, f"{args} {strategy}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def in_process(run_dir: Path, args: List[str]) -> None:
    """Train one process here, in the caller's process (a test's: transformers is imported already)."""
    from launcher.recipe import load
    from launcher.run.train import train

    train(load(RECIPE, [f"run_dir={run_dir}", *args]))


def final_loss(done: subprocess.CompletedProcess) -> float:
    return float(re.search(r"train/loss ([0-9.e+-]+)", done.stdout.splitlines()[-1]).group(1))


def outside(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], rtol: float = 1e-5,
            atol: float = 1e-6) -> List[Tuple[float, str]]:
    """(largest difference, name) of each parameter of b outside rtol/atol of a's, largest first."""
    assert a.keys() == b.keys()
    found = []
    for key in a:
        x, y = a[key].double(), b[key].double()
        if not torch.all((x - y).abs() <= atol + rtol * x.abs()):
            found.append(((x - y).abs().max().item(), key))
    return sorted(found, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", help="comma-separated: bert, gpt2, t5, vit")
    parser.add_argument("optimizers", help="comma-separated: " + ", ".join(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    parser.add_argument("--out", default="/tmp/hf_tolerance", help="where the runs go (default /tmp/hf_tolerance)")
    args = parser.parse_args()
    out = Path(args.out)
    for model, optimizer in itertools.product(args.models.split(","), args.optimizers.split(",")):
        common = [*overrides(model, optimizer, args.steps), "checkpoint.resume=never", *args.overrides]
        loss = final_loss(launch(out / f"{model}-{optimizer}-single", common))
        one = torch.load(out / f"{model}-{optimizer}-single" / "model.pt", weights_only=True)
        for strategy in ("ddp", "fsdp"):
            other_loss = final_loss(launch(out / f"{model}-{optimizer}-{strategy}", common, strategy))
            two = torch.load(out / f"{model}-{optimizer}-{strategy}" / "model.pt", weights_only=True)
            worst = outside(one, two)
            print(f"{model:5} {optimizer:14} {strategy}x2: {len(worst)} of {len(one)} parameters outside rtol 1e-5 "
                  f"(largest {worst[0][0]:.1e} in {worst[0][1]})" if worst else
                  f"{model:5} {optimizer:14} {strategy}x2: all {len(one)} parameters within rtol 1e-5",
                  f"| loss {loss:.4f} / {other_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
