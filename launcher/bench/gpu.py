"""python -m launcher.bench.gpu [--steps 300] [--reps 3] [--size 124M|tiny] [--device cuda|cpu]
                              [--no-compile | --compiled-only | --fsdp | --tf32 | --finetune | --fp8 | --sft [--no-peers]
                               | --moe]

The charlm recipe (a character-level GPT on Hamlet) in bf16 on one GPU, eager and with torch.compile,
through the launcher (`launcher.bench.child recipes/charlm.yaml ...`) and through a hand-written
best-practice loop of the same model and the same work per step (launcher/bench/raw_gpt.py),
alternating, each run in a fresh process, the order reversed every repetition.

Per compile setting and side: the median step time, tokens/s (batch x block / step time), MFU
(tokens/s x the model's flops_per_token() / the device's dense bf16 peak, launcher.observe.throughput), the
peak memory allocated, and the step-time ratio ours / raw: the median over repetitions of runs made
next to each other, with its range (1.02 is 0.98x raw's throughput).

Sizes: 124M, for the GPU: 10 layers, 16 heads of 64, 1024 wide, 1024 characters of context, batch 32
(126M parameters, 0.88 GFLOP a token; 32K tokens a step). tiny, a smoke test on the CPU: 2 layers,
64 wide, block 32, batch 8. Hamlet's training split is 157K characters, 152 windows of 1024: an epoch
is 4 steps of 32, and the data loops over epochs; both sides see data of the same shape.

Both sides read the device only every 50 steps and time each step by when it was dispatched; see
launcher/bench/raw_gpt.py for why the median then is the steady-state step time. Machines are noisy:
compare the ratios of one run, and give figures with the date and the device (both printed).

`--fsdp` runs instead the launcher's eager side under strategy fsdp against strategy ddp, one process
each (torchrun): step time, tokens/s and peak memory (one GPU: FSDP shards nothing, so this is its
overhead; its memory gain needs several GPUs).

`--tf32` runs instead the launcher's eager side in fp32 with `tf32=true` against `tf32=false`: what
TF32 matmuls give on this GPU (the recipe's `tf32` is torch's default, off for matmuls, until this row
shows it helps).

`--finetune` runs instead the fine-tuning row (launcher/bench/finetune/row.py): a Llama-3.2-1B-shaped HF
folder fine-tuned under fsdp on one GPU, bf16, compiled, activation checkpointing off and on, against HF
Trainer on the same folder and data (with `--size tiny`, its smoke test on the CPU, any `--steps` from 3).

`--fp8` runs instead the fp8 row (launcher/bench/finetune/fp8.py): the same 1B Llama, compiled, precision fp8 (torchao)
against bf16: tokens/s and the loss after --steps steps.

`--sft` runs instead the SFT row (launcher/bench/sft/row.py) on the device: a Llama-3.2-1B-shaped folder fine-tuned
by recipes/hf_sft.yaml in bf16 on generated chat data of 20 to 2,000 tokens (max_len 2048, batch 8), padded
against packed as real tokens a second, and TRL's SFTTrainer packing the same samples (`--no-peers`: without it;
`--size tiny`: the CPU row's tiny size, a smoke test). Each repetition runs three sides of --steps steps: `--steps 100 --reps 1` first.

`--moe` runs instead the MoE row (launcher/bench/moe/gpu.py): a Qwen3-MoE of Qwen3-30B-A3B's layer, 4 of them, under
ep x N against fsdp x N on the machine's N GPUs (skipped, saying so, with fewer than 2): tokens/s, the step ratio and
the all-to-all's share of ep's step from the launcher's profiler window. `--steps 100 --reps 2` first; `--device cpu
--size tiny` is its smoke test (2 processes, gloo).

Where one command may run only 10 minutes, `--no-compile` and `--compiled-only` split the GPU benchmark
into two commands (the whole is 12 fresh runs, 6 of them compiling: expect it to pass 10 minutes).

Docs: docs/performance.md#on-a-gpu (in the source tree).
"""

from __future__ import annotations

import argparse
import tempfile
import datetime
import statistics
import sys

import torch

from launcher.bench.runs import PY, alternate, median, ratio
from launcher.observe.throughput import peak_flops
from recipes.components.gpt import GPT

# layers, heads, embd, block, batch
SIZES = {"124M": (10, 16, 1024, 1024, 32), "tiny": (2, 2, 64, 32, 8)}
READ_EVERY = 50  # raw_gpt's read interval, and so the launcher's trainer.log_every here
VOCAB = 65  # hamlet.txt's distinct characters (recipes/charlm.yaml's model.vocab_size)


def sides(args, shape: tuple, compile: bool) -> dict:
    layers, heads, embd, block, batch = shape
    cuda = args.device.startswith("cuda")
    raw = [PY, "-m", "launcher.bench.raw_gpt", "--steps", str(args.steps), "--batch", str(batch), "--block", str(block),
           "--layers", str(layers), "--heads", str(heads), "--embd", str(embd), "--device", args.device,
           *(["--compile"] if compile else [])]
    ours = [PY, "-m", "launcher.bench.child", "recipes/charlm.yaml", "on_cpu=null",
            f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={embd}", f"model.block_size={block}",
            "model.dropout=0.0", f"data.batch_size={batch}", "data.val=null", "metrics={}",
            f"trainer.max_steps={args.steps}", "trainer.eval_every=null", f"trainer.log_every={READ_EVERY}",
            f"trainer.compile={str(compile).lower()}", "checkpoint.every=null", "checkpoint.resume=never",
            "logging.tensorboard=false", "logging.progress_bar=false", f"devices={args.device}", "precision=bf16",
            *(["optimizer.fused=true"] if cuda else []), f"run_dir={args.run_dir}/ours"]
    return {"raw": (raw, {}), "ours": (ours, {})}


def strategy_sides(args, shape: tuple) -> dict:
    """The launcher's side (eager) under ddp and under fsdp, each one process started by torchrun."""
    ours, _ = sides(args, shape, compile=False)["ours"]
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    return {name: ([*torchrun, *ours[1:], f"strategy={name}", f"run_dir={args.run_dir}/{name}"], {})
            for name in ("ddp", "fsdp")}


def tf32_sides(args, shape: tuple) -> dict:
    """The launcher's side (eager) in fp32, its matmuls in TF32 (tf32=true) and not (tf32=false)."""
    ours, _ = sides(args, shape, compile=False)["ours"]
    fp32 = [a for a in ours if a != "precision=bf16" and not a.startswith("run_dir=")] + ["precision=fp32"]
    return {name: ([*fp32, f"tf32={str(name == 'tf32').lower()}", f"run_dir={args.run_dir}/{name}"], {})
            for name in ("fp32", "tf32")}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size", choices=sorted(SIZES), default="124M")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, help="sequences per step instead of the size's")
    parser.add_argument("--peak-tflops", type=float, help="one device's peak, for MFU where it is not known")
    parser.add_argument("--recompute", choices=("off", "on", "both"), default="both",
                        help="with --finetune: activation checkpointing off, on, or each (default)")
    parser.add_argument("--with-trainer", action="store_true",
                        help="with --fp8: HF Trainer alternates with both sides (the fine-tuning row without recompute)")
    parser.add_argument("--single", action="store_true",
                        help="with --fp8: bf16 and fp8 under strategy=single too, one process without torchrun")
    parser.add_argument("--no-peers", dest="peers", action="store_false",
                        help="with --sft: padded against packed alone, without TRL's SFTTrainer")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--no-compile", dest="settings", action="store_const", const=(False,), default=(False, True))
    which.add_argument("--compiled-only", dest="settings", action="store_const", const=(True,))
    which.add_argument("--fsdp", dest="settings", action="store_const", const=("fsdp",),
                       help="instead: the launcher under fsdp against ddp (one process each): memory and tokens/s")
    which.add_argument("--tf32", dest="settings", action="store_const", const=("tf32",),
                       help="instead: the launcher in fp32 with tf32=true against tf32=false (what TF32 gives)")
    which.add_argument("--finetune", dest="settings", action="store_const", const=("finetune",),
                       help="instead: fine-tuning a Llama-3.2-1B-shaped HF folder, fsdp, against HF Trainer")
    which.add_argument("--fp8", dest="settings", action="store_const", const=("fp8",),
                       help="instead: that 1B Llama compiled in precision fp8 (torchao) against bf16")
    which.add_argument("--sft", dest="settings", action="store_const", const=("sft",),
                       help="instead: chat SFT of that 1B Llama, padded against packed, and TRL's SFTTrainer")
    which.add_argument("--moe", dest="settings", action="store_const", const=("moe",),
                       help="instead: a Qwen3-MoE under ep x N against fsdp x N on the N GPUs here (the all-to-all's share)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu --size tiny for a smoke test")
    # (the sft and moe rows' sides log every 10 steps; the tiny fine-tuning row is a smoke test, timed after half)
    smoke = args.settings == ("finetune",) and args.size == "tiny"
    if smoke and args.steps < 3:
        raise SystemExit(f"--steps {args.steps}: give 3 or more (a step timed after the first half)")
    if args.steps <= READ_EVERY and args.settings not in (("sft",), ("moe",)) and not smoke:
        raise SystemExit(f"--steps {args.steps}: give more than {READ_EVERY} (each side reads the device every "
                         f"{READ_EVERY} steps, and the first 50 are warm-up)")

    with tempfile.TemporaryDirectory(prefix="launcher-bench-gpu-") as args.run_dir:  # the runs' folders, removed after
        return measure(args, argv)


def measure(args, argv) -> int:
    if args.settings == ("sft",):
        return _sft(args, argv)
    if args.settings == ("moe",):
        from launcher.bench.moe.gpu import measure as moe

        return moe(args, f"{device_name(args.device)}, {datetime.date.today().isoformat()}, torch {torch.__version__}, "
                         f"{args.steps} steps, {args.reps} alternating repetitions (python -m launcher.bench.gpu "
                         f"{' '.join(sys.argv[1:] if argv is None else argv)})")
    if args.settings in (("finetune",), ("fp8",)):
        from launcher.bench.finetune.row import measure as finetune
        from launcher.bench.finetune.fp8 import measure as fp8

        print(f"{device_name(args.device)}, {datetime.date.today().isoformat()}, torch {torch.__version__}, {args.steps} "
              f"steps, {args.reps} alternating repetitions (python -m launcher.bench.gpu "
              f"{' '.join(sys.argv[1:] if argv is None else argv)})", flush=True)
        if args.settings == ("fp8",):
            return fp8(args)
        return finetune(args, peak_flops(torch.device(args.device), args.peak_tflops))
    layers, heads, embd, block, batch = SIZES[args.size]
    batch = args.batch or batch
    shape = (layers, heads, embd, block, batch)
    with torch.device("meta"):  # the model's own FLOP count, without building its weights
        model = GPT(VOCAB, block, layers, heads, embd, dropout=0.0, bias=False)
    flops_per_token, params = model.flops_per_token(), model.num_params()
    peak = peak_flops(torch.device(args.device), args.peak_tflops)
    tokens = batch * block

    print(f"charlm GPT, bf16, {params / 1e6:.{1 if params > 1e7 else 3}f}M parameters ({layers} layers, {heads} heads, "
          f"{embd} wide), block {block}, batch {batch} ({tokens} tokens a step), {flops_per_token / 1e6:,.1f} MFLOP a "
          f"token", flush=True)
    print(f"{device_name(args.device)}, peak {peak / 1e12:g} TFLOP/s bf16" if peak else
          f"{device_name(args.device)}, peak unknown (no MFU; --peak-tflops X)", flush=True)
    command = " ".join(["python -m launcher.bench.gpu", *(sys.argv[1:] if argv is None else argv)])
    warm_up = min(50, (args.steps - 1) // 2)  # StepClock.report's
    print(f"{datetime.date.today().isoformat()}, torch {torch.__version__}, {args.steps} steps ({warm_up} of warm-up), "
          f"{args.reps} alternating repetitions ({command})", flush=True)
    pairs = {("fsdp",): (strategy_sides, ("ddp", "fsdp")), ("tf32",): (tf32_sides, ("fp32", "tf32"))}
    last = f"{pairs[args.settings][1][1]}/{pairs[args.settings][1][0]}" if args.settings in pairs else "ours/raw"
    print(f"{'':9} {'side':5} {'step':>9} {'tokens/s':>10} {'MFU':>6} {'memory':>9}  {last} (range)", flush=True)
    if args.settings in pairs:
        made, names = pairs[args.settings]
        return _pair(args, made(args, shape), names, tokens)
    for compile in args.settings:
        res = alternate(sides(args, shape, compile), args.reps)  # a side that fails ends it: SystemExit, its stderr
        if set(res) != {"raw", "ours"}:
            raise SystemExit(f"a side gave no figures ({', '.join(res) or 'neither'} did)")
        r, lo, hi = ratio(res, "ours")
        for side in ("raw", "ours"):
            step_s = median(res[side], "median_step_us") / 1e6
            rate = tokens / step_s
            mfu = f"{rate * flops_per_token / peak:6.1%}" if peak else f"{'-':>6}"
            mem = [run["max_memory_gib"] for run in res[side] if "max_memory_gib" in run]
            memory = f"{statistics.median(mem):6.2f}GiB" if mem else f"{'-':>9}"
            tail = f"  {r:5.3f} ({lo:.3f}-{hi:.3f})" if side == "ours" else ""
            print(f"{'compiled' if compile else 'eager':9} {side:5} {step_s * 1e3:7.2f}ms {rate:10,.0f} {mfu} "
                  f"{memory}{tail}", flush=True)
    return 0


def _sft(args, argv) -> int:
    """The SFT row on this device: the 1B size, or the tiny one."""
    from launcher.bench.sft.row import sft

    command = " ".join(["python -m launcher.bench.gpu", *(sys.argv[1:] if argv is None else argv)])
    print(f"{device_name(args.device)}, {datetime.date.today().isoformat()}, torch {torch.__version__}", flush=True)
    args.sft_steps = args.steps
    print("\n".join(sft(args, "tiny" if args.size == "tiny" else "1B", args.device, command)), flush=True)
    return 0


def _pair(args, made: dict, names: tuple, tokens: int) -> int:
    """Two launcher sides, the second's step time over the first's (fsdp / ddp, tf32 / fp32)."""
    res = alternate(made, args.reps)
    if set(res) != set(names):
        raise SystemExit(f"a side gave no figures ({', '.join(res) or 'neither'} did)")
    first, second = names
    r = [f["median_step_us"] / d["median_step_us"] for f, d in zip(res[second], res[first])]
    for side in names:
        step_s = median(res[side], "median_step_us") / 1e6
        mem = [run["max_memory_gib"] for run in res[side] if "max_memory_gib" in run]
        memory = f"{statistics.median(mem):6.2f}GiB" if mem else f"{'-':>9}"
        tail = f"  {statistics.median(r):5.3f} ({min(r):.3f}-{max(r):.3f})" if side == second else ""
        print(f"{'eager':9} {side:5} {step_s * 1e3:7.2f}ms {tokens / step_s:10,.0f} {'-':>6} {memory}{tail}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
