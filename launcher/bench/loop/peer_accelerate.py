"""Benchmark peer: the reference workload trained through HuggingFace Accelerate, timed like raw.py.

    python -m launcher.bench.loop.peer_accelerate STEPS
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m launcher.bench.loop.peer_accelerate STEPS

Accelerate reads torchrun's environment (gloo on CPU). Exits 3 when accelerate is not installed."""

import sys

import torch
from torch import nn

from launcher.bench.workload import StepClock, finish, make_data, make_model

try:
    from accelerate import Accelerator
except ImportError:
    print("accelerate is not installed", file=sys.stderr)
    sys.exit(3)

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
BATCH = 64


def main() -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world = accelerator.num_processes
    # Accelerate shards whole batches across processes: per-process batch keeps the global batch at 64.
    loader = torch.utils.data.DataLoader(make_data(), batch_size=BATCH // world, shuffle=True, drop_last=True)
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loss_fn = nn.CrossEntropyLoss()
    # (a run of under 100 steps reads no loss, as the hand-written loop's: nan)
    clock, step, total, mean = StepClock(), 0, torch.zeros((), device=accelerator.device), float("nan")
    while step < STEPS:
        for x, y in loader:  # the prepared loader sets the sampler's epoch itself
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            total += loss.detach()
            step += 1
            clock.tick()
            if step % 100 == 0:
                mean = (accelerator.reduce(total, "sum") / 100 / world).item()  # host sync: once per 100 steps
                total.zero_()
            if step >= STEPS:
                break
    if accelerator.is_main_process:
        clock.report(loss=mean)
    accelerator.end_training()


if __name__ == "__main__":
    main()
    finish()
