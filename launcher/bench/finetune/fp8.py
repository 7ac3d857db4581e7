"""The fp8 row of python -m launcher.bench.gpu (`--fp8`): the Llama-3.2-1B-shaped model of the fine-tuning row
(launcher/bench/finetune/row.py), fine-tuned from its bf16 HF folder by recipes/hf_finetune.yaml under fsdp on one
GPU, compiled, with `precision=fp8` (torchao's Float8Linear: every Linear but the output head multiplies in
fp8 with dynamic scaling, FSDP gathers the weights in fp8) against `precision=bf16`, alternating, each run a
fresh process. Per side: the median step time, tokens/s, the peak memory allocated, and the last logged
training loss (the mean of the last 50 steps); then fp8's tokens/s over bf16's (issue 26 asks >= 1.2) and
its loss against bf16's (asked: within 1%). It needs a GPU with fp8 matmuls (compute capability 8.9+).

With `--with-trainer`, HF Trainer on the same folder and data (the fine-tuning row's peer, bf16, compiled)
alternates with both: the bf16 side is the fine-tuning row's own side without activation checkpointing, so
one command (three runs instead of four) gives that row's ours / Trainer too. With `--single`, both precisions
also run under strategy=single, one process without torchrun (Trainer's own setting: one process against one)."""

from __future__ import annotations

import statistics
from pathlib import Path

from launcher.bench.finetune.row import LENGTH_BATCH, SHAPES, _sides
from launcher.bench.runs import PY, alternate, median


def measure(args) -> int:
    from recipes.components.hf_folder import write

    length, batch = LENGTH_BATCH["1B"]
    batch = args.batch or batch
    folder = Path(args.run_dir) / "base"
    write(str(folder), dtype="bf16", **SHAPES["1B"])
    made = _sides(args, folder, length, batch, checkpointing=False, compile=True)
    base = [a for a in made["ours"][0] if not a.startswith(("precision=", "run_dir="))]
    sides = {name: ([*base, f"precision={name}", f"run_dir={args.run_dir}/{name}"], {}) for name in ("bf16", "fp8")}
    if getattr(args, "single", False):  # one process, no torchrun: the strategy a one-GPU user may choose
        plain = [PY, "-m", *base[base.index("launcher.bench.child"):]]
        for name in ("bf16", "fp8"):
            sides[f"{name} single"] = ([*(a if a != "strategy=fsdp" else "strategy=single" for a in plain),
                                        f"precision={name}", f"run_dir={args.run_dir}/{name}-single"], {})
    if getattr(args, "with_trainer", False):
        sides["Trainer"] = made["peer"]
    print(f"fp8 against bf16: a 1B Llama from a bf16 HF folder, fsdp on one device, compiled, batch {batch} of {length} "
          f"tokens, {args.steps} steps", flush=True)
    print(f"{'side':11} {'step':>9} {'tokens/s':>10} {'memory':>9} {'loss':>8}", flush=True)
    res = alternate(sides, args.reps)
    if set(res) != set(sides):
        raise SystemExit(f"a side gave no figures ({', '.join(res) or 'neither'} did)")
    for side in sides:
        step_s = median(res[side], "median_step_us") / 1e6
        mem = [run["max_memory_gib"] for run in res[side] if "max_memory_gib" in run]
        memory = f"{statistics.median(mem):6.2f}GiB" if mem else f"{'-':>9}"
        loss = f"{median(res[side], 'loss'):8.4f}" if all(run.get("loss") is not None for run in res[side]) else f"{'-':>8}"
        print(f"{side:11} {step_s * 1e3:7.2f}ms {batch * length / step_s:10,.0f} {memory} {loss}", flush=True)
    speed = [b["median_step_us"] / f["median_step_us"] for f, b in zip(res["fp8"], res["bf16"])]
    loss = median(res["fp8"], "loss") / median(res["bf16"], "loss") - 1
    print(f"fp8 / bf16: tokens/s {statistics.median(speed):.3f} ({min(speed):.3f}-{max(speed):.3f}; asked >= 1.2), "
          f"loss {loss:+.2%} (asked within 1%)", flush=True)
    if "Trainer" in res:
        vs = [b["median_step_us"] / t["median_step_us"] for b, t in zip(res["bf16"], res["Trainer"])]
        print(f"bf16 (ours, no recompute) / Trainer: step {statistics.median(vs):.3f} ({min(vs):.3f}-{max(vs):.3f}; "
              f"issue 25 asks <= 0.95)", flush=True)
    if "Trainer" in res and "bf16 single" in res:
        vs = [b["median_step_us"] / t["median_step_us"] for b, t in zip(res["bf16 single"], res["Trainer"])]
        print(f"bf16 single (one process against one) / Trainer: step {statistics.median(vs):.3f} "
              f"({min(vs):.3f}-{max(vs):.3f})", flush=True)
    return 0
