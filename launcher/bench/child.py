"""The launcher side: `python -m launcher ...` with a StepClock ticking at the end of every optimizer
step (the same instrumentation as the hand-written loop's). With BENCH_FETCH=per-item, an in-memory
TensorDataset is fetched item by item and collated, as the hand-written loop's DataLoader does, so
that the loop's own cost shows apart from the gain of batched fetching. The report also gives the
bytes this rank holds in parameters, gradients and optimizer state at the end of training (of a
sharded tensor, this rank's shard)."""

import os
import sys

import torch

import launcher.train
from launcher import data
from launcher.bench.workload import StepClock
from launcher.cli import main
from launcher.metrics import TrainMeter


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer state (a DTensor counts its local shard)."""
    def size(t) -> int:
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    params = [p for p in model.parameters()]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"param_bytes": sum(size(p) for p in params),
            "grad_bytes": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer_bytes": sum(size(v) for v in state)}


def run(argv) -> int:
    clock = StepClock()
    step_done = TrainMeter.step_done

    def ticking(self, grad_norm):
        step_done(self, grad_norm)
        clock.tick()

    TrainMeter.step_done = ticking
    fit, held = launcher.train.fit, {}

    def measured(parts, *args):
        out = fit(parts, *args)
        held.update(held_bytes(parts.model, parts.optimizer), loss=out.get("train/loss"))
        return out

    launcher.train.fit = measured
    if os.environ.get("BENCH_FETCH") == "per-item":
        data.TensorBatches = lambda dataset: dataset
    code = main(argv)
    if os.environ.get("RANK", "0") == "0":
        clock.report(**held)
    return code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
