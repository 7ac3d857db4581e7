"""The limit for the GPU benchmark: a hand-written bf16 training loop, best practice, of the GPT of
recipes/charlm.yaml on CharText(recipes/data/hamlet.txt), doing per step the work the launcher does
with that recipe (launcher/run/loop.py): autocast bf16 around forward and loss, backward, clip_grad_norm_,
AdamW step (fused on CUDA), zero_grad(set_to_none=True), the cosine schedule's step.

    python -m launcher.bench.raw_gpt --steps N --batch B --block T --layers L --heads H --embd E \
        --device cuda|cpu [--compile]

Timing. A StepClock tick ends every step, and nothing reads the device between reads: the loss is
summed on the device and read every 50 steps (the launcher's trainer.log_every in the benchmark),
after a `torch.cuda.synchronize()`. Between reads the host runs ahead of the GPU, so a tick marks
when a step was *dispatched*, not when it ran; but CUDA's launch queue is bounded, so once it is full
every launch waits for a kernel to finish and the host advances at the GPU's pace. The ticks then
come one GPU step apart, except the few after a read (the queue refilling: short) and the one that
includes the read (the queue draining: long); the median over many steps is the steady-state step
time, i.e. the throughput. When the host is the bottleneck instead, the ticks are its own pace, which
is the throughput too. The launcher ticks at the same place (each optimizer step, then its read
every log_every steps), so the two medians compare like with like. A sync per step would instead
measure a loop that never overlaps host and device, which neither side runs.

The BENCH line's `loss` is the mean training loss of the last read interval, as the launcher's
last logged train/loss.

Docs: docs/performance.md#on-a-gpu (in the source tree).
"""

from __future__ import annotations

import argparse

import torch

from launcher.bench.workload import StepClock, finish
from launcher.data.collate import default as collate
from recipes.components.chars import CharText
from recipes.components.gpt import GPT, SequenceCrossEntropy

READ_EVERY = 50  # the launcher's trainer.log_every in the benchmark: the one host read per interval
TEXT = "recipes/data/hamlet.txt"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--embd", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model, as trainer.compile=true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    data = CharText(TEXT, args.block, split="train")
    torch.manual_seed(0)
    model = GPT(data.vocab_size, args.block, args.layers, args.heads, args.embd, dropout=0.0, bias=False).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if args.compile:  # as the launcher's trainer.compile=true: the first step compiles (inside the warm-up)
        model = torch.compile(model)  # (nn.Module.compile() in place did nothing on torch 2.13 here)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=cuda or None)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    loss_fn = SequenceCrossEntropy()
    # Whole batches through CharText.__getitems__ (collate passes a fetched batch through), as the launcher.
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True,
                                         collate_fn=collate, pin_memory=cuda)
    if len(loader) == 0:
        raise SystemExit(f"{len(data)} windows of {args.block} characters are fewer than one batch of {args.batch}")

    clock, step, since_read = StepClock(), 0, 0
    total, mean = torch.zeros((), device=device), float("nan")
    while step < args.steps:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            total += loss.detach()
            step, since_read = step + 1, since_read + 1
            clock.tick()  # the step is dispatched (see the docstring): the launcher ticks here too
            if step % READ_EVERY == 0 or step == args.steps:
                if cuda:
                    torch.cuda.synchronize()  # the one wait of the interval (.item() below would wait too)
                mean = (total / since_read).item()
                total.zero_()
                since_read = 0
            if step >= args.steps:
                break
    clock.report(loss=mean, compile=args.compile, tokens_per_step=args.batch * args.block)


if __name__ == "__main__":
    main()
    finish()
