"""The MoE row of python -m launcher.bench.gpu (`--moe`): on every GPU of the machine (N, at least 2), a Qwen3-MoE
under fsdp x N with parallel.ep=N against fsdp x N alone (launcher/bench/moe/row.py builds both runs), bf16, each run a
fresh torchrun, alternating: tokens/s, the step ratio, and the all-to-all's share of ep's step.

The model has Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top 8, 32 query heads and 4 key-value heads
of 128), 4 of them, on byte tokens: 2.5B parameters, 0.23B of them active a token. Each rank reads 8 passages of
1024 tokens a step. N is the most GPUs that divide the 128 experts; with fewer than 2 the row is one line saying so.
`--device cpu --size tiny` runs it on 2 processes with gloo at the CPU row's size: a smoke test.

Tokens/s and the step are the steady figures of each run's metrics.jsonl (launcher/bench/moe/row.py), from the log
intervals before the profiled steps. The all-to-all's share comes from the launcher's own profiler window over
ep's last PROFILED steps on every rank (profile.at_step, profile.ranks; torch.profiler, nothing added to the
loop): the time in which an all-to-all was in flight on a rank (the union of NCCL's send/receive kernels, which
is how NCCL runs an all-to-all; on the CPU, gloo's `gloo:all_to_all` ranges), over the profiled steps' wall time
(their `ProfilerStep#` ranges, on the GPU where the trace has them), the mean over the ranks, with their range.
It holds the transfer and the wait for the group's slowest rank: a rank whose experts got more tokens keeps the
others waiting in the next all-to-all. No other collective of this layout sends point to point: fsdp's are
all-gathers and reduce-scatters, the meter's an all-reduce."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from launcher.bench.moe.row import CPU, LOG_EVERY, alternated, ratios, recipe, torchrun

GPU = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4,
           num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)
SIZES = {"gpu": (GPU, 8, 1024, "bf16"), "tiny": (CPU, 8, 64, "fp32")}  # shape, passages a rank, tokens, precision
PROFILED = 2  # ep's last steps, profiled on every rank
KERNEL = re.compile(r"SendRecv|AllToAll", re.I)  # NCCL's kernels of an all-to-all


def ranks(device: str, gpus: int, experts: int) -> Tuple[Optional[int], str]:
    """How many ranks the row runs on and what they are, or (None, why it is skipped)."""
    if not device.startswith("cuda"):
        return 2, "2 processes on the CPU (gloo)"
    if gpus < 2:
        return None, (f"MoE row skipped: {gpus} GPU here; ep x N against fsdp x N needs 2 or more (the all-to-all "
                      f"crosses GPUs)")
    n = max(k for k in range(1, gpus + 1) if experts % k == 0)
    return n, f"{n} GPUs (nccl)" + (f" of the {gpus} here (the most that divide {experts} experts)" if n < gpus else "")


def is_all_to_all(event: dict) -> bool:
    name = event.get("name", "")
    if name.startswith("gloo:all_to_all"):
        return True
    collective = str((event.get("args") or {}).get("Collective name", ""))
    return event.get("cat") == "kernel" and bool(KERNEL.search(name) or re.search(r"all_?to_?all", collective))


def union(spans: Iterable[Tuple[float, float]]) -> float:
    """The length of the union of intervals (start, end)."""
    total, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def share(trace: dict) -> float:
    """The all-to-all's share of the profiled steps in one rank's trace (the module's docstring)."""
    events = [e for e in trace["traceEvents"] if "dur" in e and "ts" in e]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    on_gpu = [e for e in steps if e.get("cat") == "gpu_user_annotation"]
    steps = on_gpu or steps
    if not steps:
        raise SystemExit("a profile of the MoE row holds no ProfilerStep range: nothing to measure against")
    first, last = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    spans = [(max(e["ts"], first), min(e["ts"] + e["dur"], last)) for e in events if is_all_to_all(e)]
    return union((a, b) for a, b in spans if b > a) / (last - first)


def shares(folder: Path, n: int) -> List[float]:
    """Each rank's all-to-all share, from the traces its profiler window wrote in `folder`/profile."""
    out = []
    for rank in range(n):
        traces = sorted((folder / "profile").glob(f"rank{rank}.*.pt.trace.json"))
        if not traces:
            raise SystemExit(f"the MoE row's ep run wrote no profile for rank {rank} in {folder / 'profile'}")
        out.append(share(json.loads(traces[-1].read_text())))
    return out


def measure(args, heading: str) -> int:
    """The row, printed; 0."""
    import torch

    shape, per_rank, tokens, precision = SIZES["tiny" if args.size == "tiny" else "gpu"]
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    n, where = ranks(args.device, gpus, shape["num_experts"])
    if n is None:
        print(where, flush=True)
        return 0
    steps, batch, folder = args.steps, per_rank * n, Path(args.run_dir) / "moe"
    if steps < 3 * LOG_EVERY:
        raise SystemExit(f"--steps {steps}: give {3 * LOG_EVERY} or more with --moe (a log line every {LOG_EVERY} "
                         f"steps, the last {PROFILED + 1} profiled or its warm-up)")
    at = steps - PROFILED + 1  # the profiler's window: its warm-up step is at - 1, left out of the steady figures
    base = [*torchrun(n), *recipe(shape, batch, tokens, steps, args.device.split(":")[0], precision)]
    window = [f"profile.at_step={at}", f"profile.steps={PROFILED}", f"profile.ranks=[{','.join(map(str, range(n)))}]"]
    sides = {f"fsdp x{n}": base, f"ep x{n}": [*base, f"parallel.ep={n}", *window]}
    print(f"{heading}\nMoE on {where}: Qwen3-MoE from its config, {shape['num_hidden_layers']} layers of "
          f"{shape['num_experts']} experts (top {shape['num_experts_per_tok']}, hidden {shape['hidden_size']}, experts "
          f"{shape['moe_intermediate_size']} wide), {precision}, AdamW, batch {batch} of {tokens} tokens ({per_rank} a "
          f"rank), steady figures from the log intervals before step {at - 1}, ep's steps {at}-{steps} profiled", flush=True)
    res = alternated(sides, args.reps, folder, batch, before=at - 1)
    traced = [shares(folder / f"ep_x{n}-{rep}", n) for rep in range(args.reps)]
    r, lo, hi = ratios(res, f"ep x{n}", f"fsdp x{n}")
    print(f"{'':8} {'step':>10} {'tokens/s':>11} {'held per rank':>14} {'peak':>9}  {'all-to-all share (ranks)':<25} "
          f"step / fsdp (range)", flush=True)
    for name, runs in res.items():
        held = statistics.median(sum(run["held"].values()) for run in runs)
        if name.startswith("ep"):
            each = [statistics.fmean(rep) for rep in traced]
            a2a = f"{statistics.median(each):.3f} ({min(min(rep) for rep in traced):.3f}-" \
                  f"{max(max(rep) for rep in traced):.3f})"
            tail = f"{r:.3f} ({lo:.3f}-{hi:.3f})"
        else:
            a2a, tail = "-", "1"
        peaks = [run["max_memory_gib"] for run in runs if run["max_memory_gib"] is not None]
        peak = f"{statistics.median(peaks):6.2f}GiB" if peaks else "-"
        print(f"{name:8} {statistics.median(x['step_s'] for x in runs) * 1e3:8.2f}ms "
              f"{statistics.median(x['tokens_per_s'] for x in runs):11,.0f} {held:11.1f}MiB {peak:>9}  {a2a:<25} {tail}",
              flush=True)
    return 0
