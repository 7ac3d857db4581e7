"""The fine-tuning row of python -m launcher.bench.gpu (`--finetune`): a Llama-3.2-1B-shaped model (16 layers,
2048 wide, 32 heads with 8 key-value heads, an MLP of 8192, a vocabulary of 128256, tied embeddings;
random weights written here as a bf16 HF folder) fine-tuned from that folder by recipes/hf_finetune.yaml
under strategy fsdp on one GPU (torchrun, one process), bf16, compiled, with activation checkpointing off
and on, against HF Trainer on the same folder, data, batch and length (launcher/bench/finetune/peer.py),
alternating, each run a fresh process. `--size tiny` is a smoke test of the same on the CPU (2 layers, 64
wide, fp32 and eager: compiling on the CPU takes longer than the run).

Per setting and side: the median step time, tokens/s (batch x length / step), MFU (6 x parameters + the
attention's 12 x layers x width x length FLOPs a token, over the device's dense bf16 peak), the peak
memory allocated, and ours / Trainer's step time (issue 25 asks <= 0.95)."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from launcher.bench.runs import PY, alternate, median

SHAPES = {"1B": dict(layers=16, width=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256, tie=True, context=2048),
          "tiny": dict(layers=2, width=64, heads=4, kv_heads=2, tie=True)}
LENGTH_BATCH = {"1B": (1024, 8), "tiny": (32, 4)}


def measure(args, peak) -> int:
    from recipes.components.hf_folder import write

    size = "tiny" if args.size == "tiny" else "1B"
    length, batch = LENGTH_BATCH[size]
    batch = args.batch or batch
    folder = Path(args.run_dir) / "base"
    write(str(folder), dtype="bf16", **SHAPES[size])
    params = _parameters(folder)
    shape = SHAPES[size]
    flops_per_token = 6 * params + 12 * shape["layers"] * shape["width"] * length
    compile = args.device.startswith("cuda")
    print(f"fine-tuning a Llama of {params / 1e6:,.1f}M parameters from a bf16 HF folder, fsdp on one device, bf16, "
          f"{'compiled' if compile else 'eager'}, batch {batch} of {length} tokens, {flops_per_token / 1e9:.2f} "
          f"GFLOP a token; the peer: HF Trainer", flush=True)
    print(f"{'':14} {'side':7} {'step':>9} {'tokens/s':>10} {'MFU':>6} {'memory':>9}  ours/Trainer (range)", flush=True)
    for checkpointing in {"off": (False,), "on": (True,), "both": (False, True)}[args.recompute]:
        res = alternate(_sides(args, folder, length, batch, checkpointing, compile), args.reps)
        if set(res) != {"peer", "ours"}:
            raise SystemExit(f"a side gave no figures ({', '.join(res) or 'neither'} did)")
        r = [o["median_step_us"] / p["median_step_us"] for o, p in zip(res["ours"], res["peer"])]
        for side in ("peer", "ours"):
            step_s = median(res[side], "median_step_us") / 1e6
            rate = batch * length / step_s
            mfu = f"{rate * flops_per_token / peak:6.1%}" if peak else f"{'-':>6}"
            mem = [run["max_memory_gib"] for run in res[side] if "max_memory_gib" in run]
            memory = f"{statistics.median(mem):6.2f}GiB" if mem else f"{'-':>9}"
            tail = f"  {statistics.median(r):5.3f} ({min(r):.3f}-{max(r):.3f})" if side == "ours" else ""
            name = "Trainer" if side == "peer" else "ours"
            print(f"{'recompute' if checkpointing else 'no recompute':14} {name:7} {step_s * 1e3:7.2f}ms {rate:10,.0f} "
                  f"{mfu} {memory}{tail}", flush=True)
    return 0


def _parameters(folder: Path) -> int:
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


def _sides(args, folder: Path, length: int, batch: int, checkpointing: bool, compile: bool) -> dict:
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cuda = args.device.startswith("cuda")  # Trainer's bf16 is CUDA's: on the CPU both sides run fp32
    ours = [*torchrun, "-m", "launcher.bench.child", "recipes/hf_finetune.yaml", "on_cpu=null", "strategy=fsdp",
            f"precision={'bf16' if cuda else 'fp32'}", f"model.config.pretrained_model_name_or_path={folder}", f"data.batch_size={batch}",
            f"data.train.min_len={length}", f"data.train.max_len={length}", f"data.train.n={max(2048, args.steps * batch)}",
            "data.val=null", f"trainer.max_steps={args.steps}", "trainer.log_every=50", "trainer.eval_every=null",
            f"trainer.activation_checkpointing={'[LlamaDecoderLayer]' if checkpointing else 'null'}",
            f"trainer.compile={str(compile).lower()}", "checkpoint.every=null", "checkpoint.consolidate=never",
            "checkpoint.resume=never", "logging.tensorboard=false", "logging.progress_bar=false",
            f"devices={args.device}", f"run_dir={args.run_dir}/ours"]
    peer = [PY, "-m", "launcher.bench.finetune.peer", str(folder), str(args.steps), str(batch), str(length),
            str(int(checkpointing)), str(int(compile))]
    return {"peer": (peer, {}), "ours": (ours, {})}
