"""The limit: a hand-written loop, best practice (loss summed on the device, read every 100 steps).
One process, or DDP under torchrun (gloo, DistributedSampler) when RANK is set.

    python -m launcher.bench.loop.raw [STEPS [BATCH [WIDTH]]]
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from launcher.bench.workload import StepClock, finish, make_data, make_model

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
BATCH = int(sys.argv[2]) if len(sys.argv) > 2 else 64
WIDTH = int(sys.argv[3]) if len(sys.argv) > 3 else 128


def main() -> None:
    torch.set_num_threads(1)
    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if ddp else 1
    data = make_data()
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0) if ddp else None
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH // world, sampler=sampler, shuffle=not ddp,
                                         drop_last=True)
    torch.manual_seed(0)
    model = make_model(WIDTH)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    clock, step, epoch, total, mean = StepClock(), 0, 0, torch.zeros(()), float("nan")
    while step < STEPS:
        if sampler is not None:
            sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            step += 1
            clock.tick()
            if step % 100 == 0:
                if ddp:
                    dist.all_reduce(total)
                mean = (total / 100 / world).item()  # host sync: once per 100 steps
                total.zero_()
            if step >= STEPS:
                break
    if not ddp or dist.get_rank() == 0:
        clock.report(loss=mean)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    finish()
